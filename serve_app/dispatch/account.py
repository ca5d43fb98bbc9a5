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

import json
import time
import uuid
from collections.abc import Callable

from serve_app.common.logs import get_logger
from serve_app.common.config import Tenant
from serve_app.common.wire import Usage
from serve_app.admission.variant_queue import VariantAdmission
from serve_app.admission.fair_share import service_cost
from serve_app.admission.service_time import request_size
from serve_app.admission.slots import Counted, Slot
from serve_app.tenancy.limits import CountedRequest, TenantLimiter
from serve_app.tenancy.token_budget import Reservation
from serve_app.observability.metrics import MeshMetrics

logger = get_logger(__name__)

#: The request id header. Serve's proxy puts it on every request (the client's own, or a
#: new one) and on every response, so the router only reads it.
REQUEST_ID_HEADER = "x-request-id"


def request_id_for(header: str | None) -> str:
    """The request's id: Serve's ``x-request-id`` (a new UUID when called without the
    proxy, e.g. through a handle)."""
    return header or uuid.uuid4().hex


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

    def counts(self, stream: bool) -> Counted:
        """How this request's service counts for its tenant while it runs (the token-fair
        order, :mod:`serve_app.admission.fair_share`): its prompt at its bound from the start,
        a non-stream's completion by time up to its ``max_tokens``; never its whole
        reservation."""
        return Counted(service_cost(self.reservation.prompt, 0),
                       0.0 if stream else service_cost(0, self.reservation.completion))

    @property
    def size(self) -> float:
        """How long this request holds a slot, relative to a short one (the admission's
        :func:`request_size` of its ``max_tokens`` reservation)."""
        return request_size(self.reservation.completion)

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
        if self._slot is not None and served > 0:
            admission, slot = self._slot
            admission.served(slot, service_cost(0, served))

    def hold_variant_slot(self, admission: VariantAdmission, slot: Slot, variant: str,
                          waited_s: float) -> None:
        """The variant's admission slot this request runs in, after ``waited_s`` s in its
        queue; released by finish."""
        self._slot = (admission, slot)
        self.tags["variant"] = variant
        self.queue_s += waited_s
        self.metrics.queue_time.observe(waited_s, self.tags)

    def give_back_variant_slot(self) -> None:
        """The variant failed before its first byte: free its slot for the next candidate."""
        if self._slot is not None:
            admission, slot = self._slot
            admission.release(slot, cost=0.0)  # it did not run there
            self._slot = None
        self.tags["variant"] = ""

    def failed_over(self, route: str, variant: str, why: str) -> None:
        """A variant failed before its first byte: count it, tell the rollout."""
        logger.warning("variant %s failed before the first byte (%s); failing over", variant,
                       why)
        self.metrics.failovers.inc(1, {"route": route, "variant": variant})
        self.observe(self._arms_of(variant), error=True, latency_s=time.monotonic() - self.t0)
        self.give_back_variant_slot()

    def _arms_of(self, variant: str) -> tuple[tuple[str, str], ...]:
        return tuple((key, arm or variant) for key, arm in self.arms)

    def took(self, stream: bool) -> None:
        """A replica took the request (:class:`~serve_app.common.wire.Accepted`): a
        non-stream abandoned from now on is charged its reservation (:meth:`finish`)."""
        self.accepted = not stream

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
        if self._tenant is not None:
            limiter, counted = self._tenant
            limiter.release(counted, sum(used))
            if counted is not None:
                self.metrics.record_tokens(self.tags["tenant"], counted.reserved, sum(used))
        if self._slot is not None:
            admission, slot = self._slot
            admission.release(slot, cost=None if abandoned else service_cost(*used),
                              size=request_size(used[1]) if used[1] and not abandoned
                              else None)
        if self.capture is not None:
            self.capture.finish(ttft_s=ttft_s, latency_s=latency, error=error_kind or (
                f"http_{status}" if status >= 400 else None))
        self.metrics.record(self.tags, status, latency, ttft_s=ttft_s,
                            prompt_tokens=usage.prompt_tokens,
                            completion_tokens=usage.completion_tokens, error_kind=error_kind)
        logger.info("access %s", json.dumps({
            "request_id": self.request_id, **{k: self.tags[k] for k in
                                              ("tenant", "route", "variant", "adapter")},
            "replica": self.replica,
            "status": status, "ttft_ms": round(ttft_s * 1000, 1) if ttft_s is not None else None,
            "latency_ms": round(latency * 1000, 1), "queue_ms": round(self.queue_s * 1000, 1),
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "error": error_kind if error_kind or status < 400 else f"http_{status}"}))
        if self.tags["variant"] and status < 400 and error_kind not in NOT_THE_ARMS_FAULT:
            truncated = error_kind == "stream_failed"
            self.observe(self._arms_of(self.tags["variant"]), error=truncated,
                         truncated=truncated, ttft_s=ttft_s, latency_s=latency)
