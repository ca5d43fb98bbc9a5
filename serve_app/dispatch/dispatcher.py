"""Send a planned request to its variants, in order, until one answers.

For each candidate of the :class:`~serve_app.request.planner.RequestPlan`: take a slot of
the variant's admission queue (:mod:`serve_app.admission.variant_queue`), call its ``LLMReplica``
through a ``DeploymentHandle``, and read the first item, the :class:`Head`, before any
byte goes to the client. Only a variant failure (:mod:`serve_app.common.failures`) moves on
to the next candidate; a request error or an internal error is this request's answer; a
full variant is a 503 now. When every candidate failed: 503 ``no_healthy_variant``.

A candidate that scaled to zero (asleep) is reached only when every candidate before it is
unavailable or failed: the request is then held for its cold start in the variant's
admission queue, or refused at once when the cold start holds all it can serve
(:mod:`serve_app.variants.cold_start`). A held stream waits with its headers sent and SSE
comment lines, so an error after that (the cold start timed out or failed) is an in-band
SSE error event instead of a status.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

from fastapi.responses import Response

from serve_app.common.logs import get_logger
from serve_app.common.errors import MeshError
from serve_app.common.failures import (RETRY_AFTER_S, Failure, handle_failure,
                                       nested_too_deeply, replica_gone)
from serve_app.admission.refusals import Rejected
from serve_app.admission.slots import Slot
from serve_app.common.wire import REPLICA_HEADER, Head, Usage, read_head
from serve_app.dispatch.account import RequestAccount
from serve_app.dispatch.relay import RelayResponse
from serve_app.request.planner import VARIANT_HEADER, RequestPlan
from serve_app.variants.cold_start import Held
from serve_app.variants.registry import VariantRegistry

logger = get_logger(__name__)


def _error_of(head: Head) -> MeshError:
    """A replica's error answer (an OpenAI error body) as the MeshError it stands for."""
    try:
        fields = json.loads(head.body or "{}").get("error") or {}
    except (ValueError, AttributeError):
        fields = {}
    code = fields.get("code")
    return MeshError(head.status, str(fields.get("message") or head.body
                                      or "the variant refused the request"),
                     param=fields.get("param"), code=str(code) if code is not None else None)


def _error_kind(head: Head) -> str | None:
    """The metric error kind of a whole answer: ``internal_error``, the code of a capacity
    refusal (``adapter_capacity``), else None (its status says it)."""
    if head.failure is Failure.INTERNAL:
        return "internal_error"
    return _error_of(head).code if head.failure is Failure.CAPACITY else None


class Dispatcher:
    """Calls variants for planned requests.

    Args:
        variants: the router's :class:`~serve_app.variants.registry.VariantRegistry` (each
            variant's handle, admission queue, availability and cold starts).
    """

    def __init__(self, variants: VariantRegistry) -> None:
        self.variants = variants
        self.availability = variants.availability
        self.cold_starts = variants.cold_starts

    async def dispatch(self, plan: RequestPlan, account: RequestAccount) -> Response:
        """Serve ``plan``: a streaming response (the relay finishes ``account``) or a whole
        one (finished here).

        Raises:
            MeshError: 503 (variant full, or none could take it) with ``Retry-After``; 500 an
                internal error; 400 a body that cannot be sent.
        """
        if plan.wake:  # the split's choice sleeps: wake it for later requests, not this one
            self.cold_starts.wake(plan.wake)
        if all(self.availability.slots(c) == 0 for c in plan.candidates):
            # One may have just started (the planner refreshed for one that may have stopped).
            await self.availability.refresh(max_age_s=0.5)
        woke = False
        for i, variant in enumerate(plan.candidates):
            if self.availability.is_asleep(variant):
                if woke:
                    continue  # one cold start per request
                woke = True
                held = self._hold(variant, plan, account)  # or 503 now, before any byte
                if plan.stream:  # headers now, comment lines while it starts
                    return RelayResponse(self._held(plan, account, plan.candidates[i:], held),
                                         variant, account, {VARIANT_HEADER: variant},
                                         on_replica_lost=self.availability.replica_lost)
                head_and_stream = await self._call(variant, plan, account,
                                                   await held.slot(), held.t0)
            else:
                head_and_stream = await self._try(variant, plan, account)
            if head_and_stream is None:
                continue
            head, stream = head_and_stream
            headers = {VARIANT_HEADER: variant, **head.headers}
            account.replica = head.headers.get(REPLICA_HEADER, "")
            if head.stream:
                return RelayResponse(stream, variant, account, headers,
                                     on_replica_lost=self.availability.replica_lost)
            usage = head.usage or Usage()
            if account.capture is not None:  # a mirrored request's answer
                account.capture.json_body = head.body
            account.finish(head.status, usage=usage, error_kind=_error_kind(head))
            return Response(head.body, status_code=head.status, media_type="application/json",
                            headers=headers)
        raise self._none_left(plan)

    @staticmethod
    def _none_left(plan: RequestPlan) -> MeshError:
        return MeshError(503, f"no variant of route {plan.route!r} can take the request now "
                         f"(tried {', '.join(plan.candidates)})", code="no_healthy_variant",
                         headers={"Retry-After": str(RETRY_AFTER_S)})

    def _hold(self, variant: str, plan: RequestPlan, account: RequestAccount) -> Held:
        """Hold the request for ``variant``'s cold start (:meth:`ColdStarts.hold`).

        Raises:
            MeshError: 503 with ``Retry-After``: the cold start holds all it can serve, or
                the variant's start failed a moment ago.
        """
        admission = self.variants.admission(variant)
        try:
            return self.cold_starts.hold(variant, admission, plan.route, lambda: admission.enter(
                plan.priority, plan.top_priority, account.tags["tenant"], account.size,
                hold_s=plan.cold_start_timeout_s, counts=account.counts(plan.stream)))
        except MeshError:
            account.tags["variant"] = variant
            raise

    async def _held(self, plan: RequestPlan, account: RequestAccount,
                    candidates: tuple[str, ...], held: Held):
        """A stream's body while ``candidates[0]`` starts from zero: comment lines, then the
        first candidate that answers, relayed. Raises MeshError for the relay to send as an
        in-band error event (its status line is already sent)."""
        slot: list = []
        async for comment in held.comments(slot):
            yield comment
        for variant in candidates:
            if variant == candidates[0]:
                head_and_stream = await self._call(variant, plan, account, slot[0], held.t0)
            elif self.availability.is_asleep(variant):
                continue  # one cold start per request
            else:
                head_and_stream = await self._try(variant, plan, account)
            if head_and_stream is None:
                continue
            head, stream = head_and_stream
            account.replica = head.headers.get(REPLICA_HEADER, "")
            if not head.stream:  # vLLM refused the request itself (its status comes in-band)
                raise _error_of(head)
            async for item in stream:
                yield item
            return
        raise self._none_left(plan)

    async def _try(self, variant: str, plan: RequestPlan, account: RequestAccount
                   ) -> tuple[Head, object] | None:
        """The head and stream of ``variant``'s answer; None when it is unavailable or had a
        variant failure (the caller moves on)."""
        admission = self.variants.admission(variant)
        asked_at = time.monotonic()
        try:
            slot = await admission.acquire(plan.priority, plan.top_priority,
                                           account.tags["tenant"], account.size,
                                           account.counts(plan.stream))
        except Rejected as r:
            if r.reason == "unavailable":  # no running replica: the next candidate
                return None
            account.tags["variant"] = variant
            raise MeshError(503, r.message, code=r.reason,
                            headers={"Retry-After": str(r.retry_after_s)}) from None
        return await self._call(variant, plan, account, slot, asked_at)

    async def _call(self, variant: str, plan: RequestPlan, account: RequestAccount,
                    slot: Slot, asked_at: float) -> tuple[Head, object] | None:
        """:meth:`_try` once the request has its admission ``slot`` (asked for at
        ``asked_at``, monotonic s)."""
        admission = self.variants.admission(variant)
        account.hold_variant_slot(admission, slot, variant, time.monotonic() - asked_at)
        self.availability.used(variant)
        request = replace(plan.request, newcomer=True) if slot.newcomer else plan.request
        stream = self.variants.handle(variant).options(stream=True).generate.remote(request)
        try:
            # A stream's head comes as soon as vLLM has checked the request, a non-stream's
            # Accepted as soon as the replica has it (a stream that waits for an adapter slot
            # is Accepted first too); waiting longer means the replica cannot take it (e.g.
            # it is on a lost node). After Accepted, the head comes when the answer (or the
            # replica's own queue_timeout_s wait for an adapter slot) is done.
            head = await read_head(stream, plan.queue_timeout_s,
                                   on_accepted=lambda: account.took(plan.stream))
        except BaseException as e:
            stream.cancel()
            if not isinstance(e, Exception):  # the client left (CancelledError)
                raise
            account.accepted = False  # it fails over: the next candidate may take it
            failure = handle_failure(e)
            if failure is Failure.REQUEST:
                raise MeshError.of(nested_too_deeply()) from None
            if failure is Failure.INTERNAL:
                logger.error("variant %s: internal error: %s: %s", variant, type(e).__name__,
                             str(e)[:2000])
                raise MeshError(500, f"internal error in variant {variant}: "
                                f"{type(e).__name__}", code="internal_error") from None
            if replica_gone(e):
                self.availability.replica_lost(variant)
            account.failed_over(plan.route, variant, f"{type(e).__name__}: {str(e)[:500]}")
            return None
        if head.failure is Failure.VARIANT:
            account.accepted = False  # it ran nothing there: the next candidate may take it
            account.failed_over(plan.route, variant, (head.body or "")[:500])
            return None
        return head, stream
