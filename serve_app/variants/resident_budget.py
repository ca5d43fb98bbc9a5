"""A mesh-wide budget of resident variants: before a cold start, evict the least recently
used idle variant.

With ``resident_budget: {max_variants: N}`` in the router's ``user_config``, at most N
variant applications have a replica (starting, running or stopping) at once (LRU model
swapping: keep the models in use resident, swap the rest out). A cold start
(:mod:`serve_app.variants.cold_start`) first asks :meth:`ResidentBudget.make_room`:

1. With fewer than N other variants resident, it goes ahead.
2. Else, if a resident variant's replica is stopping already, it waits for that one.
3. Else it evicts the least recently used *evictable* variant: one whose ``LLMReplica``
   uses the resident-budget autoscaling policy (:mod:`serve_app.control.resident_policy`),
   with a RUNNING replica (not starting), and no request or shadow mirror of this router in
   flight or queued for it. It takes it out of routing at once (its requests wait for a cold
   start instead), tells its replicas (``LLMReplica.evict``, which lapses after
   ``evict_timeout_s`` + :data:`EVICT_LAPSE_S`), and waits until it has no replica (at most
   ``evict_timeout_s``; else it undoes the eviction). The policy stops the last replica only
   while its engine has no request in flight, whoever sent it: a variant with work is never
   evicted.
4. With nothing evictable: 503 ``resident_budget_full`` with ``Retry-After``.

One lock orders the router's choices of room, so two cold starts at once do not both take
the last room; it is not held while an eviction runs, so one eviction never holds up another
cold start.
Each router replica keeps its own view (the Serve controller's replica counts, ~1 s old):
two routers that start different variants at the same moment may pass the budget by one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from serve_app.common.errors import MeshError
from serve_app.common.logs import get_logger
from serve_app.common.shared_task import start_shared_task

logger = get_logger(__name__)

#: The error code of the budget's refusal.
BUDGET_FULL = "resident_budget_full"
#: ``Retry-After`` of ``resident_budget_full``, s: about one request's time on a busy variant.
BUDGET_RETRY_AFTER_S = 10
#: Seconds between the eviction's status checks.
EVICT_CHECK_S = 1.0
#: Seconds between ``evict`` calls while the variant runs several replicas (a call reaches
#: one replica).
EVICT_RESEND_S = 5.0
#: Longest one ``evict`` call may take, s.
EVICT_CALL_TIMEOUT_S = 10.0
#: An eviction stands on a replica for ``evict_timeout_s`` plus this, s, then lapses (a
#: router that gave up, or died, does not leave it standing).
EVICT_LAPSE_S = 30.0


class ResidentBudget:
    """The router's resident budget.

    Args:
        handle_for: application name -> ``DeploymentHandle`` of its ``LLMReplica``.
        availability: the availability view (states, ``evictable``, ``evicting``, last use).
        busy: application -> whether this router has requests in flight or queued for it.
        metrics: the router's metrics (``evictions``); None in unit tests.
    """

    def __init__(self, handle_for: Callable, availability, busy: Callable[[str], bool],
                 metrics=None) -> None:
        self.handle_for = handle_for
        self.availability = availability
        self.busy = busy
        self.metrics = metrics
        self.max_variants: int | None = None  # None: no budget
        self.evict_timeout_s = 60.0
        self._lock = asyncio.Lock()
        self._evictions: dict[str, asyncio.Task] = {}

    def configure(self, max_variants: int | None, evict_timeout_s: float = 60.0) -> None:
        self.max_variants = max_variants
        self.evict_timeout_s = evict_timeout_s

    def resident(self, but: str = "") -> list[str]:
        """Variants with a replica or a cold start under way
        (:meth:`VariantAvailability.resident`), ``but`` left out."""
        return [a for a in self.availability.deployed_variants()
                if a != but and self.availability.resident(a)]

    def why_kept(self, application: str) -> str:
        """Why a resident variant may not be evicted now ("" if it may)."""
        if application not in self.availability.evictable:
            return "does not use the resident-budget autoscaling policy"
        if application in self.availability.evicting:
            return "is being evicted"
        if self.availability.state(application) != "warm":
            return "is starting"
        return "has requests in flight or queued" if self.busy(application) else ""

    def victim(self, application: str) -> str | None:
        """The least recently used variant that may be evicted to make room for
        ``application``; None if none may."""
        idle = [a for a in self.resident(but=application) if not self.why_kept(a)]
        return min(idle, key=self.availability.last_used, default=None)

    async def make_room(self, application: str) -> None:
        """Return once ``application`` may start within the budget: at once when there is
        room or it runs already; after a variant whose replica is stopping has stopped; or
        after evicting the least recently used idle variant. No budget: returns at once.

        Raises:
            MeshError: 503 ``resident_budget_full`` with ``Retry-After``: no resident
                variant may be evicted (the message says why for each), or the one waited
                for did not stop within ``evict_timeout_s``.
        """
        if self.max_variants is None:
            return
        if (evicting := self._evictions.get(application)) is not None:
            await asyncio.shield(evicting)  # it is stopping: start it again once it stopped
        async with self._lock:
            await self.availability.refresh(status=True)
            if self.availability.running(application):
                return  # it runs (its last eviction gave up): the wake joins its replica
            resident = self.resident(but=application)
            if len(resident) < self.max_variants:
                return
            stopping = [a for a in resident if self.availability.is_stopping(a)]
            victim = stopping[0] if stopping else self.victim(application)
            if victim is None:
                raise self._full(application, resident, "none may be evicted: " + "; ".join(
                    f"{a} {self.why_kept(a)}" for a in resident))
            # Out of routing now, before any other request can pick it.
            self.availability.evicting.add(victim)
            task = start_shared_task(self._evict(victim, application, send=not stopping))
            self._evictions[victim] = task
            task.add_done_callback(lambda t: self._evictions.get(victim) is t
                                   and self._evictions.pop(victim))
        # Not under the lock: an eviction takes up to evict_timeout_s, and other cold starts
        # meanwhile choose among the rest (this victim is evicting: it is not chosen twice).
        if not await asyncio.shield(task):
            raise self._full(application, resident, f"{victim} did not stop within "
                             f"evict_timeout_s {self.evict_timeout_s:g}")

    async def _evict(self, victim: str, for_application: str, send: bool = True) -> bool:
        """Evict ``victim`` (``send``; else it is stopping already) and wait until it has no
        replica, at most ``evict_timeout_s``; whether it got there. ``victim`` is in
        ``availability.evicting`` until then (the caller put it there)."""
        t0 = time.monotonic()
        deadline = t0 + self.evict_timeout_s
        if send:
            logger.info("resident budget (max_variants %d) is full: evicting %s, the least "
                        "recently used idle variant, to start %s", self.max_variants, victim,
                        for_application)
        else:
            logger.info("resident budget (max_variants %d) is full: waiting for %s, which is "
                        "stopping, to start %s", self.max_variants, victim, for_application)
        stopped, sent_at = False, time.monotonic()
        try:
            if send:  # the victim was warm a moment ago (make_room chose it so)
                await self._call_evict(victim, self.evict_timeout_s + EVICT_LAPSE_S)
            while True:
                # Its replicas, not a cold start of it: a request for it may wait to wake it.
                if not self.availability.has_replica(victim):
                    stopped = True
                    break
                if time.monotonic() >= deadline:
                    break
                # A call reaches one replica: send it again while several run. Not to a
                # lone replica: a call that arrives once it stopped would wake the variant.
                if send and self.availability.running(victim) > 1 \
                        and time.monotonic() - sent_at >= EVICT_RESEND_S:
                    sent_at = time.monotonic()
                    await self._call_evict(victim, self.evict_timeout_s + EVICT_LAPSE_S)
                await asyncio.sleep(EVICT_CHECK_S)
                await self.availability.refresh(status=True)
            if send and not stopped and self.availability.state(victim) == "warm":
                await self._call_evict(victim, 0.0)  # it stays (another router's request?)
        finally:
            self.availability.evicting.discard(victim)
        took = time.monotonic() - t0
        if stopped:
            logger.info("resident budget: %s has no replica after %.1f s", victim, took)
        else:
            logger.warning("resident budget: %s still has a replica after %.1f s; it stays",
                           victim, took)
        if send and self.metrics is not None:
            self.metrics.evictions.inc(1, {"variant": victim,
                                           "outcome": "stopped" if stopped else "timed_out"})
        return stopped

    async def _call_evict(self, victim: str, for_s: float) -> None:
        """``LLMReplica.evict(for_s)`` on one replica of ``victim`` (0: undo); a failure is
        logged (the status checks tell whether it stopped)."""
        try:
            await asyncio.wait_for(self.handle_for(victim).evict.remote(for_s),
                                   EVICT_CALL_TIMEOUT_S)
        except Exception as e:
            logger.warning("evict(%g) call to %s failed: %s: %s", for_s, victim,
                           type(e).__name__, str(e)[:300])

    def _full(self, application: str, resident: list[str], why: str) -> MeshError:
        return MeshError(503, f"variant {application} cannot start: the mesh's resident "
                         f"budget of {self.max_variants} variant(s) is full ({', '.join(resident)}"
                         f"), and {why}; retry later", code=BUDGET_FULL,
                         headers={"Retry-After": str(BUDGET_RETRY_AFTER_S)})

    def status(self) -> dict | None:
        """For ``/health``: the budget and the variants resident now; None without one."""
        if self.max_variants is None:
            return None
        return {"max_variants": self.max_variants, "resident": self.resident(),
                "evicting": sorted(self.availability.evicting)}
