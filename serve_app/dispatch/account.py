"""``RequestAccount``: the one owner of a request's accounting.

A request holds up to two slots while it runs (its tenant's, :mod:`serve_app.tenancy.limits`,
and its variant's, :mod:`serve_app.admission.variant_queue`) and ends in one metrics record, one
access log line and, when it went through a rollout, one observation. The account holds all
of them and :meth:`RequestAccount.finish` releases and records everything exactly once,
whoever calls it first: the router for an error or a non-streaming answer, the relay
(:class:`~serve_app.dispatch.relay.RelayResponse`) when a stream ends, fails or its client
leaves.

The access log line (``access {...}`` in the router replica's Serve log) is one JSON object
per request: ``request_id``, ``tenant``, ``route``, ``variant``, ``adapter``,
``status``, ``ttft_ms``, ``latency_ms``, ``queue_ms``, ``prompt_tokens``,
``completion_tokens``, ``error``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from serve_app.common.logs import get_logger
from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError
from serve_app.common.wire import REPLICA_HEADER, Head, Usage
from serve_app.admission.variant_queue import VariantAdmission
from serve_app.admission.slots import Ask, Slot
from serve_app.tenancy.limits import CountedRequest, TenantLimiter
from serve_app.tenancy.token_budget import Reservation
from serve_app.observability.metrics import MeshMetrics

logger = get_logger(__name__)

#: Error kinds that say nothing of the arm that served (the request's own fault, our code's,
#: the client leaving); only completed requests and variant failures are observations.
NOT_THE_ARMS_FAULT = ("client_disconnected", "internal_error", "request_error")

#: ``observe(arms, error=, truncated=, ttft_s=, latency_s=)``, see
#: :meth:`serve_app.control.rollout_client.RolloutClient.observe`.
Observe = Callable[..., None]


class RequestAccount:
    """Slots, metrics and rollout observation of one request.

    Args:
        metrics: the router's metrics.
        observe: where rollout observations go.
        tags: metric labels (route, variant, tenant, adapter), from the config only.
        request_id: the request's id (response header, vLLM's request id, logs).
    """

    def __init__(self, metrics: MeshMetrics, observe: Observe, tags: dict[str, str],
                 request_id: str) -> None:
        self.t0 = time.monotonic()
        self.request_id = request_id
        self.queue_s = 0.0
        self.metrics = metrics
        self.observe = observe
        self.tags = dict(tags)
        self.arms: tuple[tuple[str, str], ...] = ()
        self.capture = None  # a PrimaryCapture when the request is mirrored (control.shadow_mirror)
        self._tenant: tuple[TenantLimiter, CountedRequest | None] | None = None
        self.reservation = Reservation()
        self.streamed_chunks = 0  # chunks relayed to the client (a stream's progress)
        self.streamed_usage = Usage()  # a stream's token counts up to what was relayed
        self.replica = ""  # the replica that answered (its x-mesh-replica), for the access log
        self.accepted = False  # a replica took this non-stream request (wire.Accepted)
        self._slot: tuple[VariantAdmission, Slot] | None = None
        self._gave_up = False  # the variant of the slot held failed over (variant_slot)
        self.finished = False

    async def hold_tenant_slot(self, limiter: TenantLimiter, tenant: Tenant | None,
                               reservation: Reservation = Reservation()) -> dict[str, str]:
        """Take the tenant's slot and reserve ``reservation``'s tokens (raises MeshError 429
        at a limit, see :meth:`TenantLimiter.acquire`); released and settled by finish.
        Returns the rate-limit headers for the response (empty: no limits)."""
        self.reservation = reservation
        counted = await limiter.acquire(tenant, reservation.total)
        self._tenant = (limiter, counted)
        if counted is not None and counted.quota.tokens is not None:
            self.metrics.record_tokens_remaining(tenant.id, counted.quota.tokens)
        return counted.quota.headers() if counted is not None else {}

    def ask(self, priority: int, top: bool, stream: bool) -> Ask:
        """What this request asks of a variant's admission: its tenant, priority, and the
        bounds of its reservation (admission works out its size and service from them)."""
        return Ask(priority, top, self.tags["tenant"], self.reservation.prompt,
                   self.reservation.completion, stream)

    def relayed(self, chunks: int, so_far: Usage | None = None) -> None:
        """``chunks`` more SSE events of a stream went to the client, ``so_far`` the stream's
        token counts up to them (None: not known; then an event counts one token): its
        progress, what it is charged if it ends without its usage chunk, and its tenant's
        service in the token-fair order as it is served (:mod:`serve_app.admission.fair_share`)."""
        self.streamed_chunks += chunks
        served = chunks
        if so_far is not None:
            served = so_far.completion_tokens - self.streamed_usage.completion_tokens
            self.streamed_usage = so_far
        if self._slot is not None:
            admission, slot = self._slot
            admission.served_tokens(slot, served)

    @asynccontextmanager
    async def variant_slot(self, admission: VariantAdmission, slot: Slot, variant: str,
                           waited_s: float) -> AsyncIterator[None]:
        """The request runs in ``slot`` of ``variant``'s ``admission`` (taken after
        ``waited_s`` s in its queue) for this block: the account owns it. When the variant
        fails before its first byte (:meth:`failed_over`, inside the block), the slot is given
        back at once, counted as nothing run; however else the request ends, :meth:`finish`
        releases it, once, with what the request used."""
        self._slot = (admission, slot)
        self.tags["variant"] = variant
        self.queue_s += waited_s
        self.metrics.queue_time.observe(waited_s, self.tags)
        try:
            yield
        finally:
            if self._slot is not None and self._slot[1] is slot and self._gave_up:
                self._slot = None
                self.tags["variant"] = ""
                admission.give_back(slot)  # it did not run there
            self._gave_up = False

    def refused_by(self, variant: str) -> None:
        """``variant``'s admission refused the request (its 503 is labelled with it)."""
        self.tags["variant"] = variant

    def labelled(self, tags: dict[str, str], arms: tuple[tuple[str, str], ...] = ()) -> None:
        """The request's metric labels (route, variant, tenant, adapter) as far as they are
        known, and the rollout arms it counts for (``RequestPlan.tags``, ``.arms``)."""
        self.tags, self.arms = dict(tags), tuple(arms)

    def mirrored(self, capture) -> None:
        """The request is mirrored to a shadow: ``capture`` (a
        :class:`~serve_app.control.shadow_mirror.PrimaryCapture`, or None) keeps its answer."""
        self.capture = capture

    def answered_by(self, head: Head) -> None:
        """A replica answered (its head): which one, for the access log; a mirrored
        non-stream's answer, for its comparison."""
        self.replica = head.headers.get(REPLICA_HEADER, "")
        if self.capture is not None and not head.stream:
            self.capture.answered(head.body)

    def relayed_text(self, text: str) -> None:
        """A piece of the stream went to the client: a mirrored request keeps it."""
        if self.capture is not None:
            self.capture.relayed(text)

    def failed_over(self, route: str, variant: str, why: str) -> None:
        """A variant failed before its first byte: count it, tell the rollout, and (inside
        :meth:`variant_slot`) give its slot back as the block ends. A replica's
        ``Accepted`` is forgotten: the next candidate may take the request."""
        logger.warning("variant %s failed before the first byte (%s); failing over", variant,
                       why)
        self.metrics.failovers.inc(1, {"route": route, "variant": variant})
        self.observe(self._arms_of(variant), error=True, latency_s=time.monotonic() - self.t0)
        self.accepted = False
        self._gave_up = True

    def _arms_of(self, variant: str) -> tuple[tuple[str, str], ...]:
        return tuple((key, arm or variant) for key, arm in self.arms)

    def took(self, stream: bool) -> None:
        """A replica took the request (:class:`~serve_app.common.wire.Accepted`): a
        non-stream abandoned from now on is charged its reservation (:meth:`finish`)."""
        self.accepted = not stream

    def ended_by(self, e: BaseException, labels: dict[str, str] | None = None,
                 quota_headers: dict[str, str] | None = None) -> None:
        """The request ended in the router by ``e`` before an answer was sent: a refusal
        (:class:`MeshError`: its status, counted by its code, with the tenant's
        ``x-ratelimit-*`` headers added to it), the client leaving (``CancelledError``: 499),
        or a bug (500). ``labels``: its metric labels, when it ended before its plan gave
        them (what is known of its tenant and body)."""
        if labels is not None:
            self.labelled(labels)
        if isinstance(e, MeshError):
            # A limited tenant's refusal after its slot was taken (503 overloaded, ...)
            # carries its x-ratelimit-* headers too, as every answer to it does.
            e.headers = {**(quota_headers or {}), **e.headers}
            # The router's own refusals (overloaded, queue_timeout, shed,
            # no_healthy_variant, internal_error) are counted by their code; the rest by
            # status.
            if e.status != 500:
                self.refused(e.status, e.code or f"http_{e.status}")
            self.finish(e.status, error_kind=e.code if e.status >= 500 and e.code else None)
        elif isinstance(e, asyncio.CancelledError):  # while queued, or waiting for a head
            self.finish(499, error_kind="client_disconnected")
        else:
            self.finish(500, error_kind="internal_error")

    def refused(self, status: int, reason: str) -> None:
        """The mesh refused the request before running it (``reason``: the error code)."""
        self.metrics.rejected.inc(1, {**self.tags, "reason": reason})

    def finish(self, status: int, *, ttft_s: float | None = None, usage: Usage = Usage(),
               error_kind: str | None = None) -> None:
        """The request ended (once; later calls do nothing): release both slots, record the
        metrics, and observe the arm unless the outcome says nothing of it.

        Args:
            status: the HTTP status sent (200 for a stream, however it ended).
            ttft_s: time to the first streamed chunk, s; None if none was sent.
            usage: token counts.
            error_kind: None for success; see :data:`serve_app.dispatch.relay.Finish`.
        """
        if self.finished:
            return
        self.finished = True
        latency = time.monotonic() - self.t0
        if usage == Usage():  # no usage chunk (a stream cut or failed): its tokens so far
            usage = self.streamed_usage
        used = self.reservation.used(usage.prompt_tokens, usage.completion_tokens,
                                     self.streamed_chunks)
        abandoned = self.accepted and error_kind == "client_disconnected" and not any(used)
        if abandoned:
            # A non-stream its client abandoned while a replica ran it (the engine request is
            # aborted). vLLM reports a non-stream's usage only with its answer, so how far it
            # got is not known here: it is charged its reservation, what its budget admitted
            # (the fair order keeps what its time counted: never a reservation).
            used = (self.reservation.prompt, self.reservation.completion)
        counted = None
        if self._tenant is not None:
            limiter, counted = self._tenant
            limiter.release(counted, sum(used))
        if self._slot is not None:
            admission, slot = self._slot
            admission.settle(slot, None if abandoned else used)
        if self.capture is not None:
            self.capture.finish(ttft_s=ttft_s, latency_s=latency, error=error_kind or (
                f"http_{status}" if status >= 400 else None))
        if self.tags["variant"] and status < 400 and error_kind not in NOT_THE_ARMS_FAULT:
            truncated = error_kind == "stream_failed"
            self.observe(self._arms_of(self.tags["variant"]), error=truncated,
                         truncated=truncated, ttft_s=ttft_s, latency_s=latency)
        logger.info("access %s", json.dumps({
            "request_id": self.request_id, **{k: self.tags[k] for k in
                                              ("tenant", "route", "variant", "adapter")},
            "replica": self.replica,
            "status": status, "ttft_ms": round(ttft_s * 1000, 1) if ttft_s is not None else None,
            "latency_ms": round(latency * 1000, 1), "queue_ms": round(self.queue_s * 1000, 1),
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "error": error_kind if error_kind or status < 400 else f"http_{status}"}))
        # the metrics last, in one place
        if counted is not None:
            self.metrics.record_tokens(self.tags["tenant"], counted.reserved, sum(used))
        self.metrics.record(self.tags, status, latency, ttft_s=ttft_s,
                            prompt_tokens=usage.prompt_tokens,
                            completion_tokens=usage.completion_tokens, error_kind=error_kind)
