"""The state of each variant that scales to zero, as the router sees it
(:mod:`serve_app.variants.availability` keeps one :class:`Lifecycle`).

A variant whose ``LLMReplica`` has ``autoscaling_config.min_replicas: 0`` (read by
:class:`~serve_app.variants.serve_view.ServeView`) is ``warm`` (a serving replica),
``starting`` (a replica on its way up, or a cold start under way: :attr:`Lifecycle.waking`),
``zero`` or ``failed`` (its cold start failed and its back-off lasts:
:attr:`Lifecycle.start_failed`). Such a variant not warm is *asleep*: not available, but a
request can wake it (:mod:`serve_app.variants.cold_start`). One the resident budget is
evicting (:attr:`Lifecycle.evicting`, :mod:`serve_app.variants.resident_budget`) is asleep from
the moment its eviction starts.

It also keeps when the router last sent each variant a request (:meth:`Lifecycle.used`): a
variant that scales to zero is polled only while in use, within
:func:`~serve_app.variants.serve_view.idle_poll_s` of its last request, so the poll does not
keep Serve's autoscaler from taking it to zero.
"""

from __future__ import annotations

import time

from serve_app.common.logs import get_logger
from serve_app.variants.serve_view import ServeView

logger = get_logger(__name__)


class Lifecycle:
    """Warm, starting, zero or failed, per variant that scales to zero, over ``serve_view``
    (the last Serve status and deployment details).

    Attributes:
        waking: applications a cold start is waking (:mod:`serve_app.variants.cold_start`
            adds and removes them).
        evicting: applications the resident budget is evicting (it adds and removes them).
        start_failed: application -> (monotonic time its back-off ends, s; why its cold
            start failed): it is not woken again, nor resident, until then.
    """

    def __init__(self, serve_view: ServeView) -> None:
        self.serve_view = serve_view
        self.waking: set[str] = set()
        self.evicting: set[str] = set()
        self.start_failed: dict[str, tuple[float, str]] = {}
        self._state: dict[str, tuple[str, float]] = {}  # app -> (state, since: epoch s)
        self._used_at: dict[str, float] = {}  # app -> monotonic time of its last request

    # -- use ------------------------------------------------------------------------------------

    def used(self, application: str) -> None:
        """The router sends ``application`` a request now (keeps its poll going)."""
        self._used_at[application] = time.monotonic()

    def last_used(self, application: str) -> float:
        """Monotonic time of the router's last request to ``application``, s (-inf: none)."""
        return self._used_at.get(application, float("-inf"))

    def in_use(self, application: str) -> bool:
        """The router sent ``application`` a request within its
        :meth:`ServeView.idle_poll_s` (it is polled, and its view trusted)."""
        return (time.monotonic() - self.last_used(application)
                < self.serve_view.idle_poll_s(application))

    def may_be_asleep(self, application: str) -> bool:
        """A warm variant that scales to zero and has been idle (no request for
        :func:`~serve_app.variants.serve_view.idle_poll_s`): it may have gone to zero since
        the last status read (up to ``STATUS_EVERY`` poll periods ago,
        :mod:`serve_app.variants.availability`)."""
        return (application in self.serve_view.scales_to_zero
                and not self.in_use(application) and self.state(application) == "warm")

    # -- states ---------------------------------------------------------------------------------

    def failed_start(self, application: str) -> str:
        """Why ``application``'s last cold start failed, while its back-off lasts; "" if it
        may be woken."""
        until, why = self.start_failed.get(application, (0.0, ""))
        return why if time.monotonic() < until else ""

    def state(self, application: str) -> str:
        """``warm`` (a serving replica), ``starting``, ``zero`` or ``failed`` (its cold start
        failed; the back-off lasts) for a variant that scales to zero; ``warm`` or ``down``
        for the others (``warm`` until a first status is read)."""
        if self.serve_view.running(application) > 0:
            return "warm"
        if application not in self.serve_view.scales_to_zero:
            return "down" if self.serve_view.serving is not None else "warm"
        if self.failed_start(application):
            return "failed"  # its cold start failed: not woken during the back-off
        if application in self.waking or self.serve_view.starting(application) > 0:
            return "starting"
        return "zero"

    def states(self) -> dict[str, dict]:
        """Per variant that scales to zero: ``{"state": ..., "since": epoch s}``."""
        return {app: {"state": state, "since": round(since, 3)}
                for app, (state, since) in sorted(self._state.items())}

    def is_asleep(self, application: str) -> bool:
        """A variant that scales to zero has no serving replica (or is being evicted) and can
        be woken: its application is deployed (RUNNING, or DEPLOYING an update) and not being
        deleted."""
        return (application in self.serve_view.scales_to_zero
                and (self.state(application) != "warm" or application in self.evicting)
                and self.serve_view.app_status(application) in ("RUNNING", "DEPLOYING"))

    def is_stopping(self, application: str) -> bool:
        """``application`` has replicas, none RUNNING or STARTING, and no cold start under
        way: they are on their way out."""
        view = self.serve_view
        return (view.has_replica(application) and not view.running(application)
                and not view.starting(application) and application not in self.waking)

    def resident(self, application: str) -> bool:
        """``application`` has a replica (:meth:`ServeView.has_replica`) or a cold start under
        way; not one whose cold start just failed (:attr:`start_failed`) while it has no
        serving replica: a start that fails or hangs does not hold the resident budget."""
        if self.failed_start(application) and not self.serve_view.running(application):
            return False
        return application in self.waking or self.serve_view.has_replica(application)

    def mark_start_failed(self, application: str, backoff_s: float, why: str) -> None:
        """A cold start of ``application`` failed (``why``): it is ``failed``, not woken and
        not resident, for ``backoff_s`` s (:meth:`failed_start`)."""
        self.start_failed[application] = (time.monotonic() + backoff_s, why)
        self.update_states()

    def update_states(self) -> None:
        """Note each variant that scales to zero whose state changed (logged, with the time,
        epoch s, for :meth:`states`); forget those no longer deployed."""
        now = time.time()
        for app in self.serve_view.scales_to_zero | set(self._state):
            if not self.serve_view.is_deployed(app):
                self._state.pop(app, None)
                continue
            state = self.state(app)
            if self._state.get(app, ("",))[0] != state:
                if app in self._state:
                    logger.info("variant %s is %s", app, state)
                self._state[app] = (state, now)
