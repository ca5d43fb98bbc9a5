"""What the Serve controller says of each application, as the router's availability view
reads it (:mod:`serve_app.variants.availability`).

Two reads, both costly for the router's CPU and so made by the availability poll only every
few periods:

- ``serve.status()`` (:meth:`ServeView.read_status`): per application, its ``LLMReplica``
  replicas that serve (:data:`SERVING_STATES`, :meth:`ServeView._serving_replicas`), those
  STARTING and those in any state, the application's status and last deploy time, the
  error of a replica that failed to start, and the ``MeshRouter`` replicas running;
- the controller's deployment details (:func:`serve_details`,
  :meth:`ServeView.read_autoscaling`), only after a deploy (an application's status or last
  deploy time moved): which variants scale to zero (``autoscaling_config.min_replicas: 0``),
  which of those the resident budget may evict (its autoscaling policy), how long each is
  polled after its last request (:func:`idle_poll_s`), and the ``max_num_seqs`` and adapter
  versions each deployed config declares (what a variant answers for before its replicas
  have).

It keeps the last view when the controller does not answer (it may be restarting).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Container

from ray import serve

from serve_app.common.adapters import adapter_key
from serve_app.common.logs import get_logger
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, ROUTER_DEPLOYMENT
from serve_app.control.resident_policy import POLICY_FUNCTION

logger = get_logger(__name__)

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
    this time a request refreshes the view first
    (:meth:`serve_app.variants.lifecycle.Lifecycle.may_be_asleep`).
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


class ServeView:
    """The last ``serve.status()`` and deployment details, per application name.

    ``serving`` is None until a status has been read; counts are ``LLMReplica`` replicas.
    """

    def __init__(self) -> None:
        self.serving: dict[str, int] | None = None  # app -> serving replicas; None: not read
        self.routers = 1  # MeshRouter replicas running, per the last status
        self.scales_to_zero: set[str] = set()  # apps whose LLMReplica has min_replicas 0
        self.evictable: set[str] = set()  # apps whose LLMReplica uses the resident policy
        # app -> (status, last deploy time) when details were last read: every `serve deploy`
        # moves the time, even one Serve applies in place between two status polls
        self._deploys_read: dict[str, tuple[str, float]] | None = None
        self._deploys: dict[str, tuple[str, float]] = {}
        self._starting: dict[str, int] = {}  # app -> STARTING replicas
        self._replica_count: dict[str, int] = {}  # app -> replicas in any state (STOPPING too)
        self._app_status: dict[str, str] = {}
        self._idle_poll_s: dict[str, float] = {}  # app -> idle_poll_s() of what it deployed
        self._declared_seqs: dict[str, int] = {}  # app -> engine_args.max_num_seqs deployed
        self._declared_adapters: dict[str, set[str]] = {}  # app -> user_config.adapters
        # deployed, as "name@vN"
        self._start_errors: dict[str, tuple[str, str]] = {}  # app -> start_error()

    # -- reads ----------------------------------------------------------------------------------

    async def read_status(self, served: Container[str]) -> bool:
        """Read ``serve.status()`` (in a thread) into the view; False, the last view kept, if
        the controller did not answer.

        Args:
            served: the applications whose replicas have answered ``serving_info`` before
                (a deploy's replacements count as serving only for those:
                :meth:`_serving_replicas`).
        """
        try:
            serve_status = await asyncio.to_thread(serve.status)
        except Exception as e:  # keep the last view; the controller may be restarting
            logger.warning("could not read Serve status: %s", e)
            return False
        apps = serve_status.applications
        running = {name: self._serving_replicas(name, app, served) for name, app in apps.items()}
        if running != self.serving:
            logger.info("variant availability (serving replicas): %s", running)
        self.serving = running
        self.routers = max(1, sum(
            (d.replica_states or {}).get("RUNNING", 0)
            for app in apps.values()
            for name, d in (app.deployments or {}).items() if name == ROUTER_DEPLOYMENT))
        self._starting = {name: self._replicas(app, "STARTING") for name, app in apps.items()}
        self._replica_count = {name: self._replicas(app) for name, app in apps.items()}
        self._app_status = {name: getattr(app.status, "value", str(app.status))
                            for name, app in apps.items()}
        self._deploys = {name: (self._app_status[name], getattr(app, "last_deployed_time_s", 0.0))
                         for name, app in apps.items()}
        self._start_errors = {name: error for name, app in apps.items()
                              if (error := self._start_error(app))[0]}
        return True

    async def read_autoscaling(self) -> None:
        """After a deploy (an application's status or last deploy time changed since the
        last read), learn which variants scale to zero, and what each deployed config
        declares, from the controller's deployment details (in a thread); the last view is
        kept if they cannot be read (the next status read tries again)."""
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

    def mark_serving(self, application: str) -> None:
        """A cold start's first answer: ``application`` has at least one serving replica
        until the next status gives the exact count (nothing before a first status)."""
        if self.serving is not None:
            self.serving[application] = max(1, self.serving.get(application, 0))

    # -- answers --------------------------------------------------------------------------------

    def running(self, application: str) -> int:
        """Serving ``LLMReplica`` replicas of ``application`` in the last status
        (:meth:`_serving_replicas`: RUNNING, or reconfigured or replaced in place; 0: none
        or not read yet)."""
        return (self.serving or {}).get(application, 0)

    def starting(self, application: str) -> int:
        """STARTING ``LLMReplica`` replicas of ``application`` in the last status."""
        return self._starting.get(application, 0)

    def has_replica(self, application: str) -> bool:
        """``application`` has a replica: starting, running or stopping (its engine may hold
        memory until the replica is gone)."""
        return self._replica_count.get(application, 0) > 0 or self.running(application) > 0

    def is_deployed(self, application: str) -> bool:
        """``application`` is in the last status (in any application status)."""
        return application in self._app_status

    def app_status(self, application: str) -> str | None:
        """``application``'s status in the last status (``RUNNING``, ``DEPLOYING``, ...;
        None: not listed)."""
        return self._app_status.get(application)

    def deployed_variants(self) -> list[str]:
        """The applications in the last Serve status (variants and the router's own)."""
        return sorted(self._app_status)

    def idle_poll_s(self, application: str) -> float:
        """:func:`idle_poll_s` of ``application``'s deployed autoscaling config, s
        (:data:`IDLE_POLL_S` when it does not scale to zero or is not read yet)."""
        return self._idle_poll_s.get(application, IDLE_POLL_S)

    def declared_seqs(self, application: str) -> int | None:
        """``engine_args.max_num_seqs`` of ``application``'s deployed config (None: it does
        not say)."""
        return self._declared_seqs.get(application)

    def declared_adapters(self, application: str) -> set[str]:
        """Adapter versions (``name@vN``) ``application``'s deployed ``user_config``
        declares (empty: none, or not read)."""
        return self._declared_adapters.get(application, set())

    def start_error(self, application: str) -> tuple[str, str]:
        """``(message, error)`` of ``application``'s last failed replica start, per the last
        status (:meth:`_start_error`; ("", "") if none failed). The message tells one
        failure from the next (Serve counts the retries in it)."""
        return self._start_errors.get(application, ("", ""))

    # -- one application of a serve.status() ---------------------------------------------------

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

    @staticmethod
    def _replicas(app, state: str | None = None) -> int:
        """``LLMReplica`` replicas of an application in ``state`` (None: in any state)."""
        deployment = app.deployments.get(REPLICA_DEPLOYMENT) if app.deployments else None
        if not deployment:
            return 0
        states = deployment.replica_states
        return sum(states.values()) if state is None else states.get(state, 0)

    def _serving_replicas(self, name: str, app, served: Container[str]) -> int:
        """``LLMReplica`` replicas of an application in a ``serve.status()`` that serve, or
        are about to serve again, with the engine they had (:data:`SERVING_STATES`).

        A replica Serve is reconfiguring in place (``UPDATING``: a ``user_config`` change)
        keeps its engine and takes requests again in a moment; Serve's handle queues what is
        sent meanwhile. During a deploy (the application ``DEPLOYING``) of a variant that has
        served before (in ``served``), replicas starting to replace the old ones count too
        once no old one is left: requests wait for them (within ``queue_timeout_s``) rather
        than being refused. A variant's first start, or a cold start from zero, is not
        counted."""
        if app.status == "DELETING":
            return 0
        if REPLICA_DEPLOYMENT not in app.deployments:
            # While Serve runs a redeployed application's build task, and after that task
            # failed (DEPLOY_FAILED), the status lists no deployments at all, yet the old
            # replicas keep serving: keep what we knew.
            return self.running(name)
        serving = sum(self._replicas(app, state) for state in SERVING_STATES)
        if not serving and app.status == "DEPLOYING" and name in served:
            serving = self._replicas(app, "STARTING")  # replacements of a replaced replica
        return serving


def _declared_adapters(deployment: dict) -> set[str]:
    """The adapter versions (``name@vN``) an ``LLMReplica`` deployment's applied
    ``user_config`` declares, from the controller's deployment details; empty when it
    declares none or says nothing readable."""
    user_config = (deployment.get("deployment_config") or {}).get("user_config")
    listed = user_config.get("adapters") if isinstance(user_config, dict) else None
    return {adapter_key(a["name"], a["version"]) for a in listed or ()
            if isinstance(a, dict) and isinstance(a.get("name"), str)
            and isinstance(a.get("version"), int)}
