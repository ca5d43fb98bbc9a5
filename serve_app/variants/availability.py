"""Which variant applications can take a request now, and what each serves: the router's
availability view.

A ``DeploymentHandle`` to a deployment with no running replica does not fail: it queues the
request until a replica appears (a minute for a vLLM engine). So the router asks the
controller (``serve.status()``, every :data:`STATUS_EVERY` x ``period_s``:
:mod:`serve_app.variants.serve_view`) which variants have a *serving* ``LLMReplica`` and
tries those first; the others stay as last resorts, as does a variant that just lost a
replica (:mod:`serve_app.variants.replica_loss`). It also asks each running variant
(``LLMReplica.serving_info``, every ``period_s``) which adapter versions it serves, so
``route:adapter`` requests go only to variants that have the adapter, and how many requests
its engine runs at once, which sets the variant's admission slots
(:mod:`serve_app.admission.variant_queue`).

A variant that scales to zero (:mod:`serve_app.variants.lifecycle`) is asked
``serving_info`` only while the router sends it requests (:meth:`VariantAvailability.used`
within :func:`idle_poll_s`): Serve's autoscaler counts the calls it finds in flight, and a
poll once a second could keep it from reaching zero. What it served when last warm
(adapters, ``max_num_seqs``) is kept while it sleeps; one asleep since the router started
answers for the adapters its deployed ``user_config`` declares, none other.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

from serve_app.common.adapters import adapter_name
from serve_app.common.logs import get_logger
from serve_app.common.shared_task import start_shared_task
from serve_app.common.wire import CALIBRATION_TOKENS, ReplicaInfo
from serve_app.variants.lifecycle import Lifecycle
from serve_app.variants.replica_loss import LOST_REPLICA_S, MISSED_POLLS_LOST, ReplicaLoss
from serve_app.variants.serve_view import (IDLE_POLL_S, SERVING_STATES, ServeView, idle_poll_s,
                                           serve_details)

__all__ = ["IDLE_POLL_S", "LOST_REPLICA_S", "MISSED_POLLS_LOST", "SERVING_STATES", "STATUS_EVERY",
           "VariantAvailability", "idle_poll_s", "serve_details"]

logger = get_logger(__name__)

#: The poll asks the Serve controller for replica counts every this many periods; in between
#: it only asks the running variants what they serve. A variant that dies in between is
#: caught by its failures (failover) and by the refresh the router makes when no candidate
#: has a slot.
STATUS_EVERY = 5


class VariantAvailability(Lifecycle):
    """Background poller of variant readiness; ``await start()`` from the replica's loop.

    It is the :class:`Lifecycle` of the variants that scale to zero (``state``, ``used``,
    ``is_asleep``, ``waking``, ``evicting``, ...), over its :class:`ServeView`, with what the
    running replicas answer (adapters, slots, lost replicas) added.

    Args:
        handle_for: application name -> ``DeploymentHandle`` of its ``LLMReplica``.
        period_s: seconds between two polls of the running variants (a ``serving_info``
            call not answered within two periods is a miss).
        on_refresh: called after every refresh, and after a cold start's first answer or
            failure (the router sets the admission slots).

    Attributes:
        adapters: application -> adapter versions (``name@vN``) its replicas last reported.
        info: application -> what its replicas last answered ``serving_info``.
        serve_view: what the Serve controller last said (:class:`ServeView`).
        losses: lost replicas and missed polls (:class:`ReplicaLoss`).
    """

    def __init__(self, handle_for, period_s: float = 1.0, on_refresh=None) -> None:
        self.handle_for = handle_for
        self.period_s = period_s
        self.on_refresh = on_refresh
        super().__init__(ServeView())
        self.losses = ReplicaLoss()
        self.adapters: dict[str, set[str]] = {}
        self.info: dict[str, ReplicaInfo] = {}
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Task | None = None
        self._refreshing_status = False  # the refresh under way asks the controller
        self._task: asyncio.Task | None = None

    # -- the poll -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take a first view, then keep refreshing it in the background."""
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        for tick in itertools.count(1):
            await asyncio.sleep(self.period_s)
            await self.refresh(status=tick % STATUS_EVERY == 0)

    async def refresh(self, max_age_s: float = 0.0, *, status: bool = True) -> None:
        """Take a new view now, unless the last one is younger than ``max_age_s`` (request
        paths pass one, so many requests to a missing variant cost one status call).

        Args:
            status: also ask the Serve controller for the replica counts; without it only
                the running variants are asked what they serve (cheap; ``serve.status()`` is
                costly for the router's CPU, docs/benchmarks.md, "Polling", so the poll asks
                for it every :data:`STATUS_EVERY` periods).
        """
        # One under way: its view is new enough, unless it skips the status we need; then
        # wait for the next one. A loop, not a recursion (a herd of callers would overflow
        # the stack), and only while it runs: a refresh that has ended but whose caller
        # has not resumed yet is awaited without yielding, so looping on it would spin.
        while (current := self._refreshing) is not None and not current.done():
            with_status = self._refreshing_status
            await asyncio.shield(current)
            if with_status or not status:
                return
        if time.monotonic() - self._refreshed_at < max_age_s:
            return
        self._refreshing_status = status or self.serve_view.serving is None
        task = self._refreshing = start_shared_task(self._refresh(status))
        try:
            await asyncio.shield(task)
        finally:
            if self._refreshing is task:
                self._refreshing = None

    async def _refresh(self, status: bool) -> None:
        if status or self.serve_view.serving is None:
            self._refreshed_at = time.monotonic()
            if not await self.serve_view.read_status(served=self.info):
                return  # the last view is kept; the controller may be restarting
            for gone in [a for a in {*self.losses.known(), *self.info}
                         if not self.serve_view.is_deployed(a)]:
                # Deleted: what its replicas did and said (polls missed, a replica lost, what
                # it served) says nothing of the application a later deploy may create under
                # the same name, whose replicas then start from nothing.
                self.losses.forget(gone)
                self.info.pop(gone, None)
                self.adapters.pop(gone, None)
            if self.on_refresh is not None:  # admission sees new replica counts at once: not
                # only after the replicas' serving_info answers below, nor after the details
                # read next (else a request meanwhile finds a variant available to the view
                # and without slots in admission: 503 no_healthy_variant)
                self.on_refresh()
            await self.serve_view.read_autoscaling()
        self.update_states()
        # Not a sleeper that is idle or being evicted: a call that reaches its handle just
        # after its replica stopped would wake it.
        up = [app for app, n in self.serve_view.serving.items()
              if n > 0 and app not in self.evicting
              and (app not in self.scales_to_zero or self.in_use(app))]
        # A call to a replica that just died queues until its replacement starts: time-box it
        # so one dead variant never freezes this view.
        answers = await asyncio.gather(
            *(asyncio.wait_for(self.handle_for(app).serving_info.remote(), self.period_s * 2)
              for app in up), return_exceptions=True)
        for app, info in zip(up, answers):
            if not isinstance(info, BaseException):
                self._take(app, info)
            elif self.losses.missed_poll(app, info):
                self.replica_lost(app)
        gone = [a for a in self.adapters if self.running(a) == 0
                and not (a in self.scales_to_zero and self.serve_view.is_deployed(a))]
        for app in gone:  # a sleeping variant keeps what it served when last warm
            del self.adapters[app]
        if self.on_refresh is not None:
            self.on_refresh()

    def _take(self, app: str, info: ReplicaInfo) -> None:
        """What a replica of ``app`` answered ``serving_info``: what the view keeps of it."""
        self.losses.answered(app, info.replica)
        if app not in self.info:
            logger.info("variant %s: a full batch of %d-token requests holds its engine "
                        "%.2f s (start-up measure)", app, CALIBRATION_TOKENS,
                        info.full_batch_service_s)
        self.info[app] = info
        self.adapters[app] = set(info.adapters)

    def mark_warm(self, application: str, info: ReplicaInfo) -> None:
        """A cold start's first answer: ``application`` has a RUNNING replica serving
        ``info`` (the next status poll gives the exact count)."""
        self.serve_view.mark_serving(application)
        self._take(application, info)
        self.used(application)
        self.update_states()
        if self.on_refresh is not None:
            self.on_refresh()

    def mark_start_failed(self, application: str, backoff_s: float, why: str) -> None:
        """A cold start of ``application`` failed (``why``): it is ``failed``, not woken and
        not resident, for ``backoff_s`` s (:meth:`Lifecycle.mark_start_failed`)."""
        super().mark_start_failed(application, backoff_s, why)
        if self.on_refresh is not None:
            self.on_refresh()

    # -- replicas and slots ---------------------------------------------------------------------

    def slots(self, application: str) -> int | None:
        """Admission slots of the application: ``max_num_seqs`` x serving replicas, its
        replicas' ``max_num_seqs`` as they last reported it, else as its deployed
        ``engine_args`` say; None while unknown (not polled yet, or its replicas have not
        answered yet and its config does not say)."""
        if self.serve_view.serving is None:
            return None
        running = self.running(application)
        info = self.info.get(application)
        if running == 0 or application in self.evicting:
            return 0
        seqs = info.max_num_seqs if info else self.serve_view.declared_seqs(application)
        return seqs * running if seqs else None

    def first_replica_slots(self, application: str) -> int:
        """Slots one replica of ``application`` will have when it starts: its
        ``max_num_seqs`` as it last reported it, else as its deployed ``engine_args`` say,
        else 1 (unknown: a cold start holds little rather than too much)."""
        info = self.info.get(application)
        if info:
            return info.max_num_seqs
        declared = self.serve_view.declared_seqs(application)
        return 1 if declared is None else declared

    def full_batch_service_s(self, application: str) -> float:
        """What a replica of the application measured at start-up for a full batch, s (the
        one whose ``serving_info`` answer the view holds; 0.0 when unknown)."""
        info = self.info.get(application)
        return info.full_batch_service_s if info else 0.0

    def replica_lost(self, application: str) -> None:
        """A call to ``application`` found its replica gone: try the other variants first for
        :data:`LOST_REPLICA_S` (it stays a last resort), or until a poll is answered by a
        replica other than the one last seen (a redeploy's new replica serves at once)."""
        known = self.info.get(application)
        self.losses.lost(application, known.replica if known else "")

    def is_available(self, application: str) -> bool:
        """True when the application has a serving replica (or nothing is known yet), has
        not just lost one and is not being evicted."""
        if self.losses.is_lost(application) or application in self.evicting:
            return False
        return self.serve_view.serving is None or self.running(application) > 0

    def prefer_available(self, candidates: Sequence[str]) -> list[str]:
        """``candidates`` with the available ones first, each group in its given order."""
        up = [c for c in candidates if self.is_available(c)]
        return up + [c for c in candidates if c not in up]

    # -- adapters -------------------------------------------------------------------------------

    def version_for(self, application: str, adapter: str) -> str | None:
        """The version (``name@vN``) a request for ``adapter`` (a name or a version) gets on
        ``application``: the version itself, or the name's default there; None if unknown."""
        if "@" in adapter:
            return adapter
        info = self.info.get(application)
        return next((v for v in (info.defaults if info else ()) if adapter_name(v) == adapter),
                    None)

    def merged(self, application: str) -> str:
        """The adapter version merged into ``application``'s model, "" if none or unknown."""
        info = self.info.get(application)
        return info.merged if info else ""

    def serves(self, application: str, adapter: str) -> bool:
        """Whether the application serves ``adapter``: a version ``name@vN``, or any version
        of ``name``. What its replicas last reported; for a variant asleep since its deploy
        (no report yet), what its deployed ``user_config.adapters`` declare."""
        if application not in self.adapters and application in self.scales_to_zero:
            versions = self.serve_view.declared_adapters(application)
        else:
            versions = self.adapters.get(application, set())
        return adapter in versions if "@" in adapter else any(
            adapter_name(v) == adapter for v in versions)

    # -- what the Serve view and the losses hold, read as before --------------------------------

    @property
    def routers(self) -> int:
        """``MeshRouter`` replicas running, per the last status (1 until one is read)."""
        return self.serve_view.routers

    @property
    def scales_to_zero(self) -> set[str]:
        """Applications whose ``LLMReplica`` has ``min_replicas: 0``."""
        return self.serve_view.scales_to_zero

    @property
    def evictable(self) -> set[str]:
        """Applications whose ``LLMReplica`` the resident budget may evict (its policy)."""
        return self.serve_view.evictable

    @property
    def _missed(self) -> dict[str, int]:
        return self.losses.missed

    def running(self, application: str) -> int:
        """:meth:`ServeView.running`: serving replicas in the last status (0: none)."""
        return self.serve_view.running(application)

    def has_replica(self, application: str) -> bool:
        """:meth:`ServeView.has_replica`: a replica starting, running or stopping."""
        return self.serve_view.has_replica(application)

    def deployed_variants(self) -> list[str]:
        """The applications in the last Serve status (variants and the router's own)."""
        return self.serve_view.deployed_variants()

    def start_error(self, application: str) -> tuple[str, str]:
        """:meth:`ServeView.start_error`: ``(message, error)``; ("", "") if none failed."""
        return self.serve_view.start_error(application)
