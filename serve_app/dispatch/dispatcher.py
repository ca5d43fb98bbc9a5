"""Send a planned request to its variants, in order, until one answers: one loop for whole
and streamed answers.

For each candidate of the :class:`~serve_app.request.planner.RequestPlan`, in order
(:meth:`Dispatcher._answers`):

1. **admit**: take a slot of the variant's admission queue
   (:meth:`~serve_app.admission.variant_queue.VariantAdmission.take`), whether the variant runs
   or sleeps: for a variant at zero replicas the queue is given the wake, and holds the
   request for its cold start (:mod:`serve_app.variants.cold_start`) or refuses it at once;
2. **own**: the request's account holds the slot for the rest of the block
   (:meth:`~serve_app.dispatch.account.RequestAccount.variant_slot`);
3. **call**: the variant's ``LLMReplica`` through a ``DeploymentHandle``, reading the first
   item, the :class:`Head`, before any byte goes to the client. Only a variant failure
   (:mod:`serve_app.common.failures`) moves on to the next candidate (the slot goes back);
   a request error or an internal error is this request's answer; a full variant is a 503
   now. When every candidate failed: 503 ``no_healthy_variant``.

A candidate that sleeps is reached only when every candidate before it is unavailable or
failed, and one cold start at most is waited for per request. A held stream waits with its
headers sent and SSE comment lines (``: waiting for smollm-v2 to start``, one every
:data:`COMMENT_EVERY_S`, which clients ignore: WHATWG HTML, "Server-sent events"), so an
error after that (the cold start timed out or failed, the request refused) is an in-band SSE
error event instead of a status.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi.responses import Response

from serve_app.common.logs import get_logger
from serve_app.common.errors import MeshError
from serve_app.common.failures import (RETRY_AFTER_S, Failure, handle_failure,
                                       nested_too_deeply, replica_gone)
from serve_app.admission.refusals import Rejected
from serve_app.admission.slots import Slot
from serve_app.common.wire import Head, Usage, read_head
from serve_app.dispatch.account import RequestAccount
from serve_app.dispatch.relay import RelayResponse
from serve_app.request.planner import VARIANT_HEADER, RequestPlan
from serve_app.variants.registry import VariantRegistry

logger = get_logger(__name__)

#: Seconds between the SSE comment lines of a stream held for a cold start.
COMMENT_EVERY_S = 5.0


@dataclass(frozen=True)
class Answer:
    """The first item of a request's answers: the variant that answered and its head."""

    variant: str
    head: Head


@dataclass(frozen=True)
class Waiting:
    """The first item of a stream held for ``variant``'s cold start: its first comment line.
    The response's headers go out with it; the comments, then the answer, follow."""

    variant: str
    comment: str


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
                internal error; 400 a body that cannot be sent; a replica's own 4xx.
        """
        if plan.wake:  # the split's choice sleeps: wake it for later requests, not this one
            self.cold_starts.wake(plan.wake)
        if all(self.availability.slots(c) == 0 for c in plan.candidates):
            # One may have just started (the planner refreshed for one that may have stopped).
            await self.availability.refresh(max_age_s=0.5)
        answers = self._answers(plan, account)
        first = await anext(answers)  # raises the refusal: before any byte
        if isinstance(first, Answer) and not first.head.stream:
            await answers.aclose()  # a whole answer: nothing follows its head
            head = first.head
            account.finish(head.status, usage=head.usage or Usage(),
                           error_kind=_error_kind(head))
            return Response(head.body, status_code=head.status, media_type="application/json",
                            headers={VARIANT_HEADER: first.variant, **head.headers})
        # a stream: its head's headers, or, held for a cold start, its first comment line
        # with the headers now and the rest as it comes
        headers = {VARIANT_HEADER: first.variant,
                   **(first.head.headers if isinstance(first, Answer) else {})}
        return RelayResponse(answers, first.variant, account, headers,
                             on_replica_lost=self.availability.replica_lost,
                             first=first.comment if isinstance(first, Waiting) else "")

    @staticmethod
    def _none_left(plan: RequestPlan) -> MeshError:
        return MeshError(503, f"no variant of route {plan.route!r} can take the request now "
                         f"(tried {', '.join(plan.candidates)})", code="no_healthy_variant",
                         headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _answers(self, plan: RequestPlan, account: RequestAccount
                       ) -> AsyncIterator[Answer | Waiting | Any]:
        """The candidates in order until one answers (the module docstring): first an
        :class:`Answer` (or, for a stream held for a cold start, a :class:`Waiting`, then
        comment lines), then a stream's items.

        Raises:
            MeshError: the request's refusal or answer as an error; after a :class:`Waiting`,
                the relay sends it as an in-band error event.
        """
        held, woke = False, False
        for variant in plan.candidates:
            asleep = self.availability.is_asleep(variant)
            if asleep and woke:
                continue  # one cold start per request
            woke = woke or asleep
            admission = self.variants.admission(variant)
            asked_at = time.monotonic()
            taking = asyncio.ensure_future(admission.take(
                account.ask(plan.priority, plan.top_priority, plan.stream),
                hold_s=plan.cold_start_timeout_s if asleep else None,
                wake=(lambda v=variant: self.cold_starts.wake_for_request(v)) if asleep
                else None))
            outcome = "served"
            try:
                # take() decides at arrival, before its first wait: a refusal (the cold start
                # holds all it can serve, its start failed a moment ago) goes out as a status
                await asyncio.sleep(0)
                if asleep and plan.stream and not taking.done():
                    yield (f": waiting for {variant} to start\n\n" if held
                           else Waiting(variant, f": waiting for {variant} to start\n\n"))
                    held = True
                    while not (await asyncio.wait({taking}, timeout=COMMENT_EVERY_S))[0]:
                        yield (f": waiting for {variant} to start "
                               f"({time.monotonic() - asked_at:.0f} s)\n\n")
                slot: Slot = await taking
            except Rejected as r:
                outcome = r.reason
                if r.reason == "unavailable" and not asleep:  # no running replica: the next
                    continue
                account.refused_by(variant)
                raise MeshError(503, r.message, code=r.reason,
                                headers={"Retry-After": str(r.retry_after_s)}) from None
            except MeshError as e:  # the wake refused: its start failed a moment ago
                outcome = e.code or "refused"
                account.refused_by(variant)
                raise
            except asyncio.CancelledError:
                outcome = "client_left"
                raise
            finally:
                if not taking.done():
                    taking.cancel()
                    await asyncio.gather(taking, return_exceptions=True)
                if asleep:
                    self.cold_starts.held(plan.route, variant, outcome,
                                          time.monotonic() - asked_at)
            async with account.variant_slot(admission, slot, variant,
                                            time.monotonic() - asked_at):
                head, stream = await self._call(variant, plan, account, slot)
                if head is None:
                    continue  # failed before its first byte: its slot goes back
                if held:  # the status line went out with the first comment
                    if not head.stream:  # vLLM refused the request itself
                        raise _error_of(head)
                else:
                    yield Answer(variant, head)
                if head.stream:
                    ended = False
                    try:
                        async for item in stream:
                            yield item
                        ended = True
                    finally:  # the client left: stop the replica's request now (it aborts
                        if not ended:  # vLLM's), not when the generator is collected
                            stream.cancel()
                return
        raise self._none_left(plan)

    async def _call(self, variant: str, plan: RequestPlan, account: RequestAccount,
                    slot: Slot) -> tuple[Head | None, Any]:
        """The head and stream of ``variant``'s answer, the request running in ``slot``;
        ``(None, None)`` when it had a variant failure before its first byte (counted with
        :meth:`RequestAccount.failed_over`: the caller moves on)."""
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
            return None, None
        if head.failure is Failure.VARIANT:  # it ran nothing there
            account.failed_over(plan.route, variant, (head.body or "")[:500])
            return None, None
        account.answered_by(head)
        return head, stream
