"""Wake a variant that scaled to zero, once per cold start, and hold its requests meanwhile.

A variant application whose ``LLMReplica`` has ``autoscaling_config.min_replicas: 0`` goes
to zero replicas when Serve's autoscaler sees no requests for its ``downscale_delay_s``
(:mod:`serve_app.ingress.availability` stops polling it when idle, so the poll does not keep
it awake). A ``DeploymentHandle`` call to a deployment with no replica is queued at the
handle, and the handle tells the Serve controller at once (Ray's scaled-to-zero push), so the
autoscaler starts one replica. The router makes one such call per cold start,
``LLMReplica.serving_info``; every request that arrives meanwhile waits on that one call, not
at the handle, so Serve sees one queued call and starts one replica. When it returns, the
variant is warm (:meth:`VariantAvailability.mark_warm`: its slots and adapters are known) and
the held requests go through admission as usual.

A request waits at most its route's ``cold_start_timeout_s``; then 503 ``cold_start_timeout``
with ``Retry-After`` (the wake goes on, and later requests join it). A stream waits with its
response headers sent and an SSE comment line (``: waiting for smollm-v2 to start``) every
:data:`COMMENT_EVERY_S`, which clients ignore (WHATWG HTML, "Server-sent events": lines
starting with ``:``) and which keep proxies' read timeouts from firing.

With a resident budget (:mod:`serve_app.ingress.resident_budget`), the wake first makes room:
it may evict the least recently used idle variant, or refuse with 503
``resident_budget_full``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from serve_app.common.errors import MeshError
from serve_app.common.logs import get_logger
from serve_app.ingress.resident_budget import BUDGET_FULL, ResidentBudget

logger = get_logger(__name__)

#: Seconds between the SSE comment lines of a stream held for a cold start.
COMMENT_EVERY_S = 5.0
#: A wake call that has not returned in this long is given up (the next request starts a
#: new one): longer than any route's ``cold_start_timeout_s`` may be.
WAKE_GIVE_UP_S = 1800.0
#: ``Retry-After`` of a ``cold_start_timeout``, s: the variant is still starting.
COLD_START_RETRY_AFTER_S = 10


def budget_full(e: BaseException) -> bool:
    """``e`` is the resident budget's refusal (:meth:`ResidentBudget.make_room`)."""
    return isinstance(e, MeshError) and e.code == BUDGET_FULL


class ColdStarts:
    """The router's cold starts of variants that scale to zero.

    Args:
        handle_for: application name -> ``DeploymentHandle`` of its ``LLMReplica``.
        availability: the availability view (``waking``, ``mark_warm``).
        metrics: the router's metrics (``cold_starts``, ``cold_start_seconds``,
            ``cold_start_held``, ``cold_start_wait_seconds``); None in unit tests.
    """

    def __init__(self, handle_for: Callable, availability, metrics=None,
                 budget: ResidentBudget | None = None) -> None:
        self.handle_for = handle_for
        self.availability = availability
        self.metrics = metrics
        self.budget = budget
        self._wakes: dict[str, asyncio.Task] = {}

    def wake(self, application: str) -> asyncio.Task:
        """The one wake call of ``application`` under way, started if there is none."""
        task = self._wakes.get(application)
        if task is None or task.done():
            self.availability.waking.add(application)
            task = asyncio.get_running_loop().create_task(self._wake(application))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no warnings
            self._wakes[application] = task
        return task

    async def _wake(self, application: str):
        t0 = time.monotonic()
        logger.info("cold start: waking variant %s (it has no replica)", application)
        try:
            if self.budget is not None:
                await self.budget.make_room(application)
            info = await asyncio.wait_for(self.handle_for(application).serving_info.remote(),
                                          WAKE_GIVE_UP_S)
        except BaseException as e:
            if budget_full(e):
                logger.warning("cold start of %s refused: %s", application, e.message)
            else:
                logger.warning("cold start of %s failed after %.1f s: %s: %s", application,
                               time.monotonic() - t0, type(e).__name__, str(e)[:300])
            self._count(application, "budget_full" if budget_full(e) else "failed")
            raise
        finally:
            self.availability.waking.discard(application)
        took = time.monotonic() - t0
        self.availability.mark_warm(application, info)
        logger.info("cold start: variant %s is warm after %.1f s", application, took)
        self._count(application, "started")
        if self.metrics is not None:
            self.metrics.cold_start_seconds.observe(took, {"variant": application})
        return info

    def _count(self, application: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.cold_starts.inc(1, {"variant": application, "outcome": outcome})

    async def wait_warm(self, application: str, timeout_s: float, route: str = "") -> None:
        """Wake ``application`` (or join its wake) and wait until it is warm.

        Args:
            timeout_s: the route's ``cold_start_timeout_s``.
            route: for the metrics.

        Raises:
            MeshError: 503 ``cold_start_timeout`` (not warm within ``timeout_s``),
                ``cold_start_failed`` (the wake call failed) or ``resident_budget_full`` (no
                room: :meth:`ResidentBudget.make_room`), with ``Retry-After``.
        """
        t0 = time.monotonic()
        outcome = "served"
        try:
            await asyncio.wait_for(asyncio.shield(self.wake(application)), timeout_s)
        except asyncio.TimeoutError:
            outcome = "timed_out"
            raise MeshError(503, f"variant {application} is starting from zero replicas and "
                            f"did not start within cold_start_timeout_s {timeout_s:g} (route "
                            f"{route!r}); retry later", code="cold_start_timeout",
                            headers={"Retry-After": str(COLD_START_RETRY_AFTER_S)}) from None
        except asyncio.CancelledError:
            outcome = "client_left"
            raise
        except Exception as e:
            if budget_full(e):  # as the budget words it
                outcome = "budget_full"
                raise
            outcome = "failed"
            raise MeshError(503, f"variant {application} could not be started from zero "
                            f"replicas ({type(e).__name__}); retry later",
                            code="cold_start_failed",
                            headers={"Retry-After": str(COLD_START_RETRY_AFTER_S)}) from None
        finally:
            if self.metrics is not None:
                tags = {"route": route, "variant": application}
                self.metrics.cold_start_held.inc(1, {**tags, "outcome": outcome})
                self.metrics.cold_start_wait_seconds.observe(time.monotonic() - t0, tags)

    async def hold_stream(self, application: str, timeout_s: float,
                          route: str = "") -> AsyncIterator[str]:
        """SSE comment lines while :meth:`wait_warm` waits (one at once, then one every
        :data:`COMMENT_EVERY_S`); ends when the variant is warm.

        Raises:
            MeshError: as :meth:`wait_warm`.
        """
        t0 = time.monotonic()
        waiting = asyncio.ensure_future(self.wait_warm(application, timeout_s, route))
        try:
            yield f": waiting for {application} to start\n\n"
            while not (await asyncio.wait({waiting}, timeout=COMMENT_EVERY_S))[0]:
                yield f": waiting for {application} to start ({time.monotonic() - t0:.0f} s)\n\n"
            waiting.result()
        finally:
            if not waiting.done():
                waiting.cancel()
