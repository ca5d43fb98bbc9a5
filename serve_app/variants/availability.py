"""Which variant applications can take a request now, as the Serve controller sees them.

A ``DeploymentHandle`` to a deployment with no running replica does not fail: it queues the
request until a replica appears (a minute for a vLLM engine). So the router asks the
controller (``serve.status()``, every :data:`STATUS_EVERY` x ``period_s``) which variants
have a *serving* ``LLMReplica`` (RUNNING, or reconfigured or replaced in place by a deploy:
:data:`SERVING_STATES`, :meth:`VariantAvailability._running_replicas`) and tries those first; the others stay as last resorts. It
also asks each running variant (``LLMReplica.serving_info``, every ``period_s``) which
adapter versions it serves, so ``route:adapter`` requests go only to variants that have the
adapter, and how many requests its engine runs at once, which sets the variant's admission
slots (:mod:`serve_app.admission.variant_queue`).

Variants that scale to zero (``LLMReplica`` ``autoscaling_config.min_replicas: 0``, read
from the controller's deployment details after each deploy) have a state: ``warm`` (a
RUNNING replica), ``starting`` (a replica on its way up) or ``zero``. Such a variant at zero
is *asleep*: not available, but a request can wake it (:mod:`serve_app.variants.cold_start`).
Its running replica is asked ``serving_info`` only while the router sends it requests
(:meth:`VariantAvailability.used` within :func:`idle_poll_s`): Serve's autoscaler counts
the calls it finds in flight when it samples, and a poll once a second could keep it from
reaching zero. What it served when last warm (adapters, ``max_num_seqs``) is kept while it
sleeps; one asleep since the router started answers for the adapters its deployed
``user_config`` declares (read from the controller's deployment details), none other. A
variant the resident budget is evicting (:mod:`serve_app.variants.resident_budget`) takes no
new requests: it is asleep from the moment its eviction starts.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Sequence

from ray import serve

from serve_app.common.logs import get_logger
from serve_app.common.adapters import adapter_key, adapter_name
from serve_app.common.failures import queue_full, replica_gone
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, ROUTER_DEPLOYMENT
from serve_app.common.shared_task import start_shared_task
from serve_app.common.wire import CALIBRATION_TOKENS, ReplicaInfo
from serve_app.control.resident_policy import POLICY_FUNCTION

logger = get_logger(__name__)

#: The poll asks the Serve controller for replica counts every this many periods; in between
#: it only asks the running variants what they serve. A variant that dies in between is
#: caught by its failures (failover) and by the refresh the router makes when no candidate
#: has a slot.
STATUS_EVERY = 5
#: Seconds a variant that just lost a replica (a call ended with Ray's "actor died" or "actor
#: unavailable") is tried only after the others. Calls to a replica on a lost node hang until
#: Ray declares its actors dead (its node health checks take 15 s or more); by then the
#: Serve status shows the variant without that replica.
LOST_REPLICA_S = 30.0
#: Polls in a row that a RUNNING variant must miss (no answer to ``serving_info`` within two
#: periods; a poll Serve's handle refused because the replica's queue is full is no miss)
#: before it counts as having lost its replica. Serve's handle then cannot place
#: even this small call, so a request would wait just as long. The router's admission keeps
#: a replica's requests far below ``max_ongoing_requests``, so load alone does not queue it.
MISSED_POLLS_LOST = 3
#: Seconds after its last request that a variant which scales to zero is still polled, at
#: most (:func:`idle_poll_s`).
IDLE_POLL_S = 10.0
#: Serve replica states in which a replica has its engine and serves, or will again in a
#: moment without a new engine: ``UPDATING`` is an in-place reconfigure (``user_config``),
#: ``PENDING_MIGRATION`` a replica on a draining node that still serves until it is moved.
SERVING_STATES = ("RUNNING", "UPDATING", "PENDING_MIGRATION")


def idle_poll_s(autoscaling_config: dict, resident_policy: bool = False) -> float:
    """Seconds after the router's last request that a variant which scales to zero is still
    polled (``serving_info``) and counts as in use: :data:`IDLE_POLL_S`, or half the idle
    time after which Serve may stop its last replica if that is shorter.

    A poll that reaches the handle after the last replica stopped would wake the variant, and
    a request sent on a view that still shows it warm would wait for its cold start; past
    this time a request refreshes the view first (:meth:`VariantAvailability.may_be_asleep`).
    Serve counts a request from its send to its end, and whatever the policy asks, stops the
    last replica only after ``downscale_to_zero_delay_s`` (if set; else ``downscale_delay_s``,
    Serve's default 600 s) with none (Ray 2.60, ``autoscaling_policy._apply_delay_logic``);
    under the resident budget's policy the replica must first be idle ``downscale_delay_s``
    (:mod:`serve_app.control.resident_policy`).

    Args:
        autoscaling_config: the deployment's ``autoscaling_config`` as the controller's
            details give it (delays in s).
        resident_policy: its ``policy`` is the resident budget's.
    """
    delay = autoscaling_config.get("downscale_delay_s", 600.0)
    to_zero = autoscaling_config.get("downscale_to_zero_delay_s")
    if to_zero is not None and not resident_policy:
        delay = to_zero
    return min(IDLE_POLL_S, delay / 2)


def serve_details() -> dict:
    """The controller's ``ServeInstanceDetails`` as a dict (what ``serve status -v`` and the
    dashboard's ``/api/serve/applications/`` show: each deployment's config included)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


class VariantAvailability:
    """Background poller of variant readiness; ``await start()`` from the replica's loop."""

    def __init__(self, handle_for, period_s: float = 1.0, on_refresh=None) -> None:
        self.handle_for = handle_for  # application name -> DeploymentHandle of its LLMReplica
        self.period_s = period_s
        self.on_refresh = on_refresh  # called after every refresh (the router sets slots)
        self._running: dict[str, int] | None = None  # app -> serving replicas; None: not polled
        self.adapters: dict[str, set[str]] = {}  # app -> adapter versions it serves, "name@vN"
        self.info: dict[str, ReplicaInfo] = {}  # app -> what its replicas last reported
        self._refreshed_at = float("-inf")
        self._lost_until: dict[str, float] = {}  # app -> monotonic time, see replica_lost
        self.routers = 1  # MeshRouter replicas running, per the last status
        self._lost_replica: dict[str, str] = {}  # app -> the replica last seen when lost
        self._missed: dict[str, int] = {}  # app -> serving_info polls missed in a row
        self._refreshing: asyncio.Task | None = None
        self._refreshing_status = False  # the refresh under way asks the controller
        self._task: asyncio.Task | None = None
        self.scales_to_zero: set[str] = set()  # apps whose LLMReplica has min_replicas 0
        # app -> (status, last deploy time) when details were last read: every `serve deploy`
        # moves the time, even one Serve applies in place between two status polls
        self._deploys_read: dict[str, tuple[str, float]] | None = None
        self._deploys: dict[str, tuple[str, float]] = {}
        self._starting: dict[str, int] = {}  # app -> STARTING replicas
        self._replica_count: dict[str, int] = {}  # app -> replicas in any state (STOPPING too)
        self._app_status: dict[str, str] = {}
        self._state: dict[str, tuple[str, float]] = {}  # app -> (state, since: epoch s)
        self._used_at: dict[str, float] = {}  # app -> monotonic time of its last request
        self._idle_poll_s: dict[str, float] = {}  # app -> idle_poll_s() of what it deployed
        self.waking: set[str] = set()  # apps a cold start is waking (cold_start sets it)
        self.evictable: set[str] = set()  # apps whose LLMReplica uses the resident policy
        self.evicting: set[str] = set()  # apps the resident budget is evicting (it sets it)
        self._declared_seqs: dict[str, int] = {}  # app -> engine_args.max_num_seqs deployed
        self._declared_adapters: dict[str, set[str]] = {}  # app -> user_config.adapters
        # deployed, as "name@vN"
        self._start_errors: dict[str, tuple[str, str]] = {}  # app -> start_error()
        self.start_failed: dict[str, tuple[float, str]] = {}  # app -> (monotonic until, why):
        # a cold start failed; it is not woken again (nor resident) until then (cold_start)

    async def start(self) -> None:
        """Take a first view, then keep refreshing it in the background."""
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._poll())

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
        self._refreshing_status = status or self._running is None
        task = self._refreshing = start_shared_task(self._refresh(status))
        try:
            await asyncio.shield(task)
        finally:
            if self._refreshing is task:
                self._refreshing = None

    async def _refresh(self, status: bool) -> None:
        if status or self._running is None:
            self._refreshed_at = time.monotonic()
            try:
                serve_status = await asyncio.to_thread(serve.status)
            except Exception as e:  # keep the last view; the controller may be restarting
                logger.warning("could not read Serve status: %s", e)
                return
            running = {name: self._running_replicas(name, app)
                       for name, app in serve_status.applications.items()}
            if running != self._running:
                logger.info("variant availability (serving replicas): %s", running)
            self._running = running
            self.routers = max(1, sum(
                (d.replica_states or {}).get("RUNNING", 0)
                for app in serve_status.applications.values()
                for name, d in (app.deployments or {}).items() if name == ROUTER_DEPLOYMENT))
            self._starting = {name: self._replicas(app, "STARTING")
                              for name, app in serve_status.applications.items()}
            self._replica_count = {name: self._replicas(app)
                                   for name, app in serve_status.applications.items()}
            self._app_status = {name: getattr(app.status, "value", str(app.status))
                                for name, app in serve_status.applications.items()}
            self._deploys = {name: (self._app_status[name],
                                    getattr(app, "last_deployed_time_s", 0.0))
                             for name, app in serve_status.applications.items()}
            self._start_errors = {name: error for name, app in serve_status.applications.items()
                                  if (error := self._start_error(app))[0]}
            for gone in [a for a in {*self._lost_until, *self._missed, *self.info}
                         if a not in serve_status.applications]:
                # Deleted: what its replicas did and said (polls missed, a replica lost, what
                # it served) says nothing of the application a later deploy may create under
                # the same name, whose replicas then start from nothing.
                for known in (self._lost_until, self._lost_replica, self._missed, self.info,
                              self.adapters):
                    known.pop(gone, None)
            if self.on_refresh is not None:  # admission sees new replica counts at once: not
                # only after the replicas' serving_info answers below, nor after the details
                # read next (else a request meanwhile finds a variant available to the view
                # and without slots in admission: 503 no_healthy_variant)
                self.on_refresh()
            await self._read_autoscaling()
        self._update_states()
        # Not a sleeper that is idle or being evicted: a call that reaches its handle just
        # after its replica stopped would wake it.
        up = [app for app, n in self._running.items()
              if n > 0 and app not in self.evicting
              and (app not in self.scales_to_zero or self._in_use(app))]
        # A call to a replica that just died queues until its replacement starts: time-box it
        # so one dead variant never freezes this view.
        answers = await asyncio.gather(
            *(asyncio.wait_for(self.handle_for(app).serving_info.remote(), self.period_s * 2)
              for app in up), return_exceptions=True)
        for app, info in zip(up, answers):
            if isinstance(info, BaseException):
                if queue_full(info):  # refused before it reached a replica: not a miss
                    continue
                self._missed[app] = self._missed.get(app, 0) + 1
                if self._missed[app] >= MISSED_POLLS_LOST or replica_gone(info):
                    self.replica_lost(app)
                continue
            self._take(app, info)
        gone = [a for a in self.adapters if self._running.get(a, 0) == 0
                and not (a in self.scales_to_zero and a in self._app_status)]
        for app in gone:  # a sleeping variant keeps what it served when last warm
            del self.adapters[app]
        if self.on_refresh is not None:
            self.on_refresh()

    async def _read_autoscaling(self) -> None:
        """After a deploy (an application's status or last deploy time changed), learn which
        variants scale to zero from the controller's deployment details."""
        if self._deploys == self._deploys_read:
            return
        try:
            details = await asyncio.to_thread(serve_details)
        except Exception as e:  # keep the last view; the next status poll tries again
            logger.warning("could not read Serve deployment details: %s", e)
            return
        self._deploys_read = dict(self._deploys)
        zero, evictable, idle_poll, declared, adapters = set(), set(), {}, {}, {}
        for name, app in (details.get("applications") or {}).items():
            engine_args = ((app.get("deployed_app_config") or {}).get("args") or {}).get(
                "engine_args") or {}
            if isinstance(engine_args.get("max_num_seqs"), int):
                declared[name] = engine_args["max_num_seqs"]
            deployment = (app.get("deployments") or {}).get(REPLICA_DEPLOYMENT) or {}
            adapters[name] = _declared_adapters(deployment)
            scaling = (deployment.get("deployment_config") or {}).get("autoscaling_config")
            if scaling and scaling.get("min_replicas", 1) == 0:
                zero.add(name)
                resident = (scaling.get("policy") or {}).get("policy_function") == \
                    POLICY_FUNCTION
                idle_poll[name] = idle_poll_s(scaling, resident_policy=resident)
                if resident:
                    evictable.add(name)
        if zero != self.scales_to_zero or evictable != self.evictable:
            logger.info("variants that scale to zero: %s (the resident budget may evict: "
                        "%s)", sorted(zero) or "none", sorted(evictable) or "none")
        self.scales_to_zero, self.evictable, self._idle_poll_s = zero, evictable, idle_poll
        self._declared_seqs = declared  # what is deployed now: none of a deleted app's
        self._declared_adapters = adapters

    def _update_states(self) -> None:
        now = time.time()
        for app in self.scales_to_zero | set(self._state):
            if app not in self._app_status:
                self._state.pop(app, None)
                continue
            state = self.state(app)
            if self._state.get(app, ("",))[0] != state:
                if app in self._state:
                    logger.info("variant %s is %s", app, state)
                self._state[app] = (state, now)

    def _take(self, app: str, info: ReplicaInfo) -> None:
        """What a replica of ``app`` answered ``serving_info``: what the view keeps of it."""
        self._missed[app] = 0
        if self._lost_until.get(app, 0.0) > time.monotonic() \
                and info.replica != self._lost_replica.get(app):
            # Another replica answers (Serve replaced the one lost, or the variant runs
            # more): a call placed now reaches it, so the variant need not wait out the mark.
            logger.info("variant %s: replica %s answers; available again", app,
                        info.replica or "?")
            self._lost_until.pop(app)
        if app not in self.info:
            logger.info("variant %s: a full batch of %d-token requests holds its engine "
                        "%.2f s (start-up measure)", app, CALIBRATION_TOKENS,
                        info.full_batch_service_s)
        self.info[app] = info
        self.adapters[app] = set(info.adapters)

    @staticmethod
    def _start_error(app) -> tuple[str, str]:
        """The error of a replica that failed to start, as the Serve controller reports it in
        the deployment's message ("A replica failed to start with exception. Retrying ...
        Error: <traceback>"): (the message, the traceback's last line that names an error,
        "RuntimeError: ..."); ("", "") if none failed."""
        deployment = app.deployments.get(REPLICA_DEPLOYMENT) if app.deployments else None
        message = str(getattr(deployment, "message", "") or "")
        if "failed to start" not in message:
            return "", ""
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*: ", line)]
        return message, (errors or lines or [message])[-1][:500]

    def start_error(self, application: str) -> tuple[str, str]:
        """``(message, error)`` of ``application``'s last failed replica start, per the last
        status (:meth:`_start_error`; ("", "") if none failed). The message tells one
        failure from the next (Serve counts the retries in it)."""
        return self._start_errors.get(application, ("", ""))

    @staticmethod
    def _replicas(app, state: str | None = None) -> int:
        """``LLMReplica`` replicas of an application in ``state`` (None: in any state)."""
        deployment = app.deployments.get(REPLICA_DEPLOYMENT) if app.deployments else None
        if not deployment:
            return 0
        states = deployment.replica_states
        return sum(states.values()) if state is None else states.get(state, 0)

    def _running_replicas(self, name: str, app) -> int:
        """``LLMReplica`` replicas of an application in a ``serve.status()`` that serve, or
        are about to serve again, with the engine they had (:data:`SERVING_STATES`).

        A replica Serve is reconfiguring in place (``UPDATING``: a ``user_config`` change)
        keeps its engine and takes requests again in a moment; Serve's handle queues what is
        sent meanwhile. During a deploy (the application ``DEPLOYING``) of a variant that has
        served before, replicas starting to replace the old ones count too once no old one is
        left: requests wait for them (within ``queue_timeout_s``) rather than being refused.
        A variant's first start, or a cold start from zero, is not counted."""
        if app.status == "DELETING":
            return 0
        if REPLICA_DEPLOYMENT not in app.deployments:
            # While Serve runs a redeployed application's build task, and after that task
            # failed (DEPLOY_FAILED), the status lists no deployments at all, yet the old
            # replicas keep serving: keep what we knew.
            return (self._running or {}).get(name, 0)
        serving = sum(self._replicas(app, state) for state in SERVING_STATES)
        if not serving and app.status == "DEPLOYING" and name in self.info:
            serving = self._replicas(app, "STARTING")  # replacements of a replaced replica
        return serving

    # -- variants that scale to zero ----------------------------------------------------------

    def used(self, application: str) -> None:
        """The router sends ``application`` a request now (keeps its poll going)."""
        self._used_at[application] = time.monotonic()

    def may_be_asleep(self, application: str) -> bool:
        """A warm variant that scales to zero and has been idle (no request for
        :func:`idle_poll_s`): it may have gone to zero since the last status poll (up to
        :data:`STATUS_EVERY` periods ago)."""
        return (application in self.scales_to_zero and not self._in_use(application)
                and self.state(application) == "warm")

    def _in_use(self, application: str) -> bool:
        return (time.monotonic() - self.last_used(application)
                < self._idle_poll_s.get(application, IDLE_POLL_S))

    def last_used(self, application: str) -> float:
        """Monotonic time of the router's last request to ``application`` (-inf: none)."""
        return self._used_at.get(application, float("-inf"))

    def deployed_variants(self) -> list[str]:
        """The applications in the last Serve status (variants and the router's own)."""
        return sorted(self._app_status)

    def running(self, application: str) -> int:
        """Serving ``LLMReplica`` replicas of ``application`` in the last status
        (:meth:`_running_replicas`: RUNNING, or reconfigured or replaced in place; 0: none
        or not polled yet)."""
        return (self._running or {}).get(application, 0)

    def has_replica(self, application: str) -> bool:
        """``application`` has a replica: starting, running or stopping (its engine may hold
        memory until the replica is gone)."""
        return self._replica_count.get(application, 0) > 0 or self.running(application) > 0

    def is_stopping(self, application: str) -> bool:
        """``application`` has replicas, none RUNNING or STARTING, and no cold start under
        way: they are on their way out."""
        return (self.has_replica(application) and not self.running(application)
                and not self._starting.get(application, 0)
                and application not in self.waking)

    def resident(self, application: str) -> bool:
        """``application`` has a replica (:meth:`has_replica`) or a cold start under way; not
        one whose cold start just failed (:attr:`start_failed`) while it has no serving
        replica: a start that fails or hangs does not hold the resident budget."""
        if self.failed_start(application) and not self.running(application):
            return False
        return application in self.waking or self.has_replica(application)

    def failed_start(self, application: str) -> str:
        """Why ``application``'s last cold start failed, while its back-off lasts; "" if it
        may be woken."""
        until, why = self.start_failed.get(application, (0.0, ""))
        return why if time.monotonic() < until else ""

    def state(self, application: str) -> str:
        """``warm`` (a serving replica), ``starting``, ``zero`` or ``failed`` (its cold start
        failed; the back-off lasts) for a variant that scales to zero; ``warm`` or ``down``
        for the others."""
        if self.running(application) > 0:
            return "warm"
        if application not in self.scales_to_zero:
            return "down" if self._running is not None else "warm"
        if self.failed_start(application):
            return "failed"  # its cold start failed: not woken during the back-off
        if application in self.waking or self._starting.get(application, 0) > 0:
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
        return (application in self.scales_to_zero
                and (self.state(application) != "warm" or application in self.evicting)
                and self._app_status.get(application) in ("RUNNING", "DEPLOYING"))

    def mark_warm(self, application: str, info: ReplicaInfo) -> None:
        """A cold start's first answer: ``application`` has a RUNNING replica serving
        ``info`` (the next status poll gives the exact count)."""
        if self._running is not None:
            self._running[application] = max(1, self._running.get(application, 0))
        self._take(application, info)
        self.used(application)
        self._update_states()
        if self.on_refresh is not None:
            self.on_refresh()

    def mark_start_failed(self, application: str, backoff_s: float, why: str) -> None:
        """A cold start of ``application`` failed (``why``): it is ``failed``, not woken and
        not resident, for ``backoff_s`` (:meth:`failed_start`)."""
        self.start_failed[application] = (time.monotonic() + backoff_s, why)
        self._update_states()
        if self.on_refresh is not None:
            self.on_refresh()

    async def _poll(self) -> None:
        for tick in itertools.count(1):
            await asyncio.sleep(self.period_s)
            await self.refresh(status=tick % STATUS_EVERY == 0)

    def slots(self, application: str) -> int | None:
        """Admission slots of the application: ``max_num_seqs`` x serving replicas, its
        replicas' ``max_num_seqs`` as they last reported it, else as its deployed
        ``engine_args`` say; None while unknown (not polled yet, or its replicas have not
        answered yet and its config does not say)."""
        if self._running is None:
            return None
        running = self.running(application)
        info = self.info.get(application)
        if running == 0 or application in self.evicting:
            return 0
        seqs = info.max_num_seqs if info else self._declared_seqs.get(application)
        return seqs * running if seqs else None

    def first_replica_slots(self, application: str) -> int:
        """Slots one replica of ``application`` will have when it starts: its
        ``max_num_seqs`` as it last reported it, else as its deployed ``engine_args`` say,
        else 1 (unknown: a cold start holds little rather than too much)."""
        info = self.info.get(application)
        return info.max_num_seqs if info else self._declared_seqs.get(application, 1)

    def full_batch_service_s(self, application: str) -> float:
        """What a replica of the application measured at start-up for a full batch, s (the
        one whose ``serving_info`` answer the view holds; 0.0 when unknown)."""
        info = self.info.get(application)
        return info.full_batch_service_s if info else 0.0

    def replica_lost(self, application: str) -> None:
        """A call to ``application`` found its replica gone: try the other variants first for
        :data:`LOST_REPLICA_S` (it stays a last resort), or until a poll is answered by a
        replica other than the one last seen (a redeploy's new replica serves at once)."""
        if self._lost_until.get(application, 0.0) <= time.monotonic():
            logger.warning("variant %s lost a replica; trying the route's other variants "
                           "first for %.0f s, or until another replica answers", application,
                           LOST_REPLICA_S)
            known = self.info.get(application)
            self._lost_replica[application] = known.replica if known else ""
        self._lost_until[application] = time.monotonic() + LOST_REPLICA_S

    def is_available(self, application: str) -> bool:
        """True when the application has a serving replica (or nothing is known yet), has
        not just lost one and is not being evicted."""
        if self._lost_until.get(application, 0.0) > time.monotonic() \
                or application in self.evicting:
            return False
        return self._running is None or self.running(application) > 0

    def prefer_available(self, candidates: Sequence[str]) -> list[str]:
        """``candidates`` with the available ones first, each group in its given order."""
        up = [c for c in candidates if self.is_available(c)]
        return up + [c for c in candidates if c not in up]

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
            versions = self._declared_adapters.get(application, set())
        else:
            versions = self.adapters.get(application, set())
        return adapter in versions if "@" in adapter else any(
            adapter_name(v) == adapter for v in versions)


def _declared_adapters(deployment: dict) -> set[str]:
    """The adapter versions (``name@vN``) an ``LLMReplica`` deployment's applied
    ``user_config`` declares, from the controller's deployment details; empty when it
    declares none or says nothing readable."""
    user_config = (deployment.get("deployment_config") or {}).get("user_config")
    listed = user_config.get("adapters") if isinstance(user_config, dict) else None
    return {adapter_key(a["name"], a["version"]) for a in listed or ()
            if isinstance(a, dict) and isinstance(a.get("name"), str)
            and isinstance(a.get("version"), int)}
