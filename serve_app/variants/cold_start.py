"""Wake a variant that scaled to zero, once per cold start, and hold what it can serve.

A variant application whose ``LLMReplica`` has ``autoscaling_config.min_replicas: 0`` goes
to zero replicas when Serve's autoscaler sees no requests for its ``downscale_delay_s``
(:mod:`serve_app.variants.availability` stops polling it when idle, so the poll does not keep
it awake). A ``DeploymentHandle`` call to a deployment with no replica is queued at the
handle, and the handle tells the Serve controller at once (Ray's scaled-to-zero push), so the
autoscaler starts one replica. The router makes one such call per cold start,
``LLMReplica.serving_info``; when it returns, the variant is warm
(:meth:`VariantAvailability.mark_warm`: its slots and adapters are known).

Requests that arrive meanwhile are held in the variant's admission queue
(:meth:`VariantAdmission.expect_start`): as many as its first replica can start within
``queue_timeout_s`` once warm, derived as admission derives its queue; the rest get 503
``overloaded`` with ``Retry-After`` at once, before any byte. When the replica is warm the
held requests get its slots in admission's order, no more at a time than it takes; each
then waits ``queue_timeout_s`` or until its ``cold_start_timeout_s`` ends, whichever is
later: the count was made with the start-up measure, and an engine slower than measured (a
2-core host under a second herd) must not shed held streams, whose 200 went out, in-band.
A held request waits at most its route's ``cold_start_timeout_s`` for the replica (then 503
``cold_start_timeout``). A stream waits with its response
headers sent and an SSE comment line (``: waiting for smollm-v2 to start``) every
:data:`COMMENT_EVERY_S`, which clients ignore (WHATWG HTML, "Server-sent events": lines
starting with ``:``) and which keep proxies' read timeouts from firing.

A start that fails (the Serve controller reports the replica's start error) or hangs (no
replica within the largest ``cold_start_timeout_s`` of the variant's routes) ends every held
request with 503 ``cold_start_failed`` and the reason; the variant is then not woken again,
and does not count against the resident budget, for a back-off (:data:`BACKOFF_S`, doubling
per failure in a row up to :data:`MAX_BACKOFF_S`); requests meanwhile get the same 503 at
once.

With a resident budget (:mod:`serve_app.variants.resident_budget`), the wake first makes room:
it may evict the least recently used idle variant, or refuse with 503
``resident_budget_full``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from serve_app.common.errors import MeshError
from serve_app.common.logs import get_logger
from serve_app.common.shared_task import start_shared_task
from serve_app.admission.refusals import Rejected
from serve_app.variants.resident_budget import BUDGET_FULL, BUDGET_RETRY_AFTER_S, ResidentBudget

logger = get_logger(__name__)

#: ``Retry-After`` of a ``cold_start_timeout``, s: the variant is still starting.
COLD_START_RETRY_AFTER_S = 10
#: First back-off after a failed cold start, s; it doubles per failure in a row.
BACKOFF_S = 10.0
#: Longest back-off, s.
MAX_BACKOFF_S = 300.0
#: Seconds between the wake's looks at the Serve status for a replica's start error.
START_ERROR_CHECK_S = 1.0


class ColdStartFailed(Exception):
    """A cold start failed: the replica's start error, or no replica in time."""


def budget_full(e: BaseException) -> bool:
    """``e`` is the resident budget's refusal (:meth:`ResidentBudget.make_room`)."""
    return isinstance(e, MeshError) and e.code == BUDGET_FULL


class ColdStarts:
    """The router's cold starts of variants that scale to zero.

    Args:
        handle_for: application name -> ``DeploymentHandle`` of its ``LLMReplica``.
        availability: the availability view (``waking``, ``mark_warm``, ``start_failed``).
        metrics: the router's metrics (``cold_starts``, ``cold_start_seconds``,
            ``cold_start_held``, ``cold_start_wait_seconds``); None in unit tests.
        budget: the resident budget (None: none).
        admission_for: application name -> its admission queue (held requests wait there);
            None: nothing is held (unit tests of the wake alone).
        give_up_s: application name -> how long its wake may take, s (the router: the
            largest ``cold_start_timeout_s`` of its routes).
    """

    def __init__(self, handle_for: Callable, availability, metrics=None,
                 budget: ResidentBudget | None = None, admission_for: Callable | None = None,
                 give_up_s: Callable[[str], float] = lambda _: 180.0) -> None:
        self.handle_for = handle_for
        self.availability = availability
        self.metrics = metrics
        self.budget = budget
        self.admission_for = admission_for
        self.give_up_s = give_up_s
        self._wakes: dict[str, asyncio.Task] = {}
        self._failures: dict[str, int] = {}  # app -> cold starts failed in a row

    def refuse_if_failed(self, application: str) -> None:
        """Raises MeshError 503 ``cold_start_failed`` (with the reason and ``Retry-After``)
        while ``application``'s back-off after a failed cold start lasts."""
        if why := self.availability.failed_start(application):
            until = self.availability.start_failed[application][0]
            raise MeshError(503, f"variant {application} could not be started from zero "
                            f"replicas: {why}; it is not started again for "
                            f"{until - time.monotonic():.0f} s", code="cold_start_failed",
                            headers={"Retry-After": str(max(1, math.ceil(
                                until - time.monotonic())))})

    def wake(self, application: str) -> asyncio.Task | None:
        """The one wake call of ``application`` under way, started if there is none; None
        while its back-off after a failed start lasts."""
        task = self._wakes.get(application)
        if task is None or task.done():
            if self.availability.failed_start(application):
                return None
            self.availability.waking.add(application)
            if self.admission_for is not None:
                self.admission_for(application).expect_start(
                    self.availability.first_replica_slots(application))
            task = start_shared_task(self._wake(application))  # the herd's, not the first's
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no warnings
            self._wakes[application] = task
        return task

    async def _wake(self, application: str):
        t0 = time.monotonic()
        logger.info("cold start: waking variant %s (it has no replica)", application)
        try:
            if self.budget is not None:
                await self.budget.make_room(application)
            info = await self._first_answer(application)
        except BaseException as e:
            self._failed(application, e, time.monotonic() - t0)
            raise
        finally:
            self.availability.waking.discard(application)
        took = time.monotonic() - t0
        self._failures.pop(application, None)
        self.availability.start_failed.pop(application, None)
        self.availability.mark_warm(application, info)
        logger.info("cold start: variant %s is warm after %.1f s", application, took)
        self._count(application, "started")
        if self.metrics is not None:
            self.metrics.cold_start_seconds.observe(took, {"variant": application})
        return info

    async def _first_answer(self, application: str):
        """The woken replica's ``serving_info``, or ColdStartFailed when the controller
        reports its start error or none answers within ``give_up_s``."""
        call = asyncio.ensure_future(self.handle_for(application).serving_info.remote())
        deadline = time.monotonic() + self.give_up_s(application)
        earlier, _ = self.availability.start_error(application)  # a start before this one
        try:
            while not (await asyncio.wait({call}, timeout=START_ERROR_CHECK_S))[0]:
                await self.availability.refresh(max_age_s=START_ERROR_CHECK_S)
                message, error = self.availability.start_error(application)
                if message and message != earlier:
                    raise ColdStartFailed(f"its replica failed to start: {error}")
                if time.monotonic() > deadline:
                    raise ColdStartFailed(f"no replica started within "
                                          f"{self.give_up_s(application):g} s "
                                          "(cold_start_timeout_s); it may hang at start")
            return call.result()
        finally:
            call.cancel()  # a call left queued at the handle would keep Serve starting it

    def _failed(self, application: str, e: BaseException, took: float) -> None:
        """A wake ended without a replica: end the held requests, and back off (not for a
        full budget or a router shutting down: nothing was wrong with the variant)."""
        if budget_full(e):
            logger.warning("cold start of %s refused: %s", application, e.message)
            self._count(application, "budget_full")
            self._end_held(application, Rejected(BUDGET_FULL, e.message, BUDGET_RETRY_AFTER_S))
            return
        if not isinstance(e, Exception):
            self._end_held(application, Rejected("cold_start_failed", f"variant "
                                                 f"{application}'s cold start was cancelled",
                                                 COLD_START_RETRY_AFTER_S))
            return
        n = self._failures[application] = self._failures.get(application, 0) + 1
        backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (n - 1))
        why = str(e) if isinstance(e, ColdStartFailed) else f"{type(e).__name__}: {e}"[:500]
        self.availability.mark_start_failed(application, backoff, why)
        logger.warning("cold start of %s failed after %.1f s (%d in a row): %s; not woken "
                       "again for %.0f s", application, took, n, why, backoff)
        self._count(application, "failed")
        self._end_held(application, Rejected(
            "cold_start_failed", f"variant {application} could not be started from zero "
            f"replicas: {why}; retry later", math.ceil(backoff)))

    def _end_held(self, application: str, rejected: Rejected) -> None:
        if self.admission_for is not None:
            self.admission_for(application).fail_start(rejected)

    def _count(self, application: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.cold_starts.inc(1, {"variant": application, "outcome": outcome})

    def wake_for_request(self, application: str) -> None:
        """A request for ``application``, which has no running replica, is about to wait in
        its admission queue (:meth:`VariantAdmission.take` calls this): the cold start under
        way, started if there is none.

        Raises:
            MeshError: 503 ``cold_start_failed`` with the reason and ``Retry-After`` while
                its back-off after a failed start lasts.
        """
        self.refuse_if_failed(application)
        self.wake(application)

    def held(self, route: str, application: str, outcome: str, waited_s: float) -> None:
        """A request held for ``application``'s cold start ended its wait: ``outcome``
        ``served``, ``client_left``, or the code of its refusal (``cold_start_timeout``,
        ``cold_start_failed``, ``resident_budget_full``, ``overloaded``, ...) after
        ``waited_s`` s (``cold_start_held``, ``cold_start_wait_seconds``)."""
        outcome = {"cold_start_timeout": "timed_out", "cold_start_failed": "failed",
                   BUDGET_FULL: "budget_full"}.get(outcome, outcome)
        if self.metrics is not None:
            tags = {"route": route, "variant": application}
            self.metrics.cold_start_held.inc(1, {**tags, "outcome": outcome})
            self.metrics.cold_start_wait_seconds.observe(waited_s, tags)
