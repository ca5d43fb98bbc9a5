"""What a new Serve config does to the running applications: which changes Serve applies in
place and which restart replicas.

Ray Serve applies a new config application by application (``serve deploy`` is declarative).
A change is classified as:

- ``restart``: Serve replaces replicas. Any change of an application's *code version*
  redeploys the whole application, and every replica of every deployment in it is replaced.
  Ray Serve 2.60 hashes into it (``ray/serve/_private/deploy_utils.py``,
  ``get_app_code_version``): the application's ``import_path``, ``runtime_env``, ``args`` and
  ``autoscaling_policy``, and each deployment's ``request_router_config``, its
  ``autoscaling_config.policy`` (adding or removing a whole ``autoscaling_config`` changes it
  too) and its ``deployment_actors``. :func:`diff_configs` checks its verdict against that
  function itself, so it cannot say "in place" where Serve restarts. A change of a
  deployment's ``ray_actor_options``,
  ``placement_group_*``, ``max_replicas_per_node``, ``gang_scheduling_config``,
  ``deployment_actors`` or ``version`` replaces that deployment's replicas. For a vLLM variant,
  a replaced replica means a new engine and no capacity until it is up: release new ``args``
  blue/green with ``meshctl swap`` instead.
- ``in_place``: a *lightweight config update*. The running replicas stay; Serve reconfigures
  them (``user_config`` goes to ``reconfigure()``). Ray Serve's docs, "Updating Applications
  In-Place" > "Lightweight Config Updates"
  (https://docs.ray.io/en/latest/serve/advanced-guides/inplace-updates.html), list
  ``num_replicas``, ``autoscaling_config``, ``user_config``, ``max_ongoing_requests``,
  ``graceful_shutdown_timeout_s``, ``graceful_shutdown_wait_loop_s``,
  ``health_check_period_s`` and ``health_check_timeout_s`` (``autoscaling_config`` but its
  ``policy``). The installed Ray 2.60's ``DeploymentConfig`` marks these options as
  non-heavyweight too: ``max_queued_requests``, ``backpressure_config``, ``logging_config``,
  ``max_constructor_retry_count``, ``rolling_update_percentage`` and ``max_surge_percent``.
  An application's ``route_prefix`` is in place as well (Ray 2.60 ``DeploymentVersion``
  reconfigures running replicas for it), and so is its ``logging_config``.
- ``added``: a new application; its replicas start, nothing else is touched.
- ``removed``: Serve stops sending it requests, lets in-flight requests finish (up to the
  deployment's ``graceful_shutdown_timeout_s``), then stops its replicas.

Fields not named above are taken as ``restart``: an unknown option is assumed to be
heavyweight. Top-level settings (``http_options``, ``proxy_location``) are not compared: a
running cluster does not apply them per application.

``live`` stands for the config deployed now, read from the Ray dashboard
(``GET /api/serve/applications/``, ``applications[*].deployed_app_config``: exactly the options
that were submitted, no defaults added).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve_app.common.serve_configs import applications

RESTART, IN_PLACE, ADDED, REMOVED = "restart", "in_place", "added", "removed"

_CODE_VERSION = "Serve hashes it into the application's code version: every replica of the " \
    "application is replaced"
_APP_RESTART_REASON = {
    "import_path": "a new import_path replaces every replica of the application",
    "args": "application args change replaces every replica",
    "runtime_env": "a runtime_env change replaces every replica of the application",
    "autoscaling_policy": f"the application's autoscaling_policy: {_CODE_VERSION}",
}
_APP_IN_PLACE = {"route_prefix", "logging_config"}
#: Deployment options in the application's code version (Ray 2.60 ``get_app_code_version``).
CODE_VERSION_DEPLOYMENT_OPTIONS = frozenset({"request_router_config", "deployment_actors"})

#: Deployment options Serve applies to running replicas (see the module docstring).
LIGHTWEIGHT_DEPLOYMENT_OPTIONS = frozenset({
    # Ray Serve docs, "Lightweight Config Updates" (autoscaling_config but its policy):
    "num_replicas", "autoscaling_config", "user_config", "max_ongoing_requests",
    "graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s", "health_check_period_s",
    "health_check_timeout_s",
    # also not heavyweight in Ray 2.60's DeploymentConfig:
    "max_queued_requests", "backpressure_config", "logging_config",
    "max_constructor_retry_count", "rolling_update_percentage", "max_surge_percent",
})


def code_version(app: dict[str, Any]) -> str:
    """Serve's own code version of an application entry of a Serve config
    (``get_app_code_version`` of Ray 2.60 on its ``ServeApplicationSchema``): when it changes,
    Serve replaces every replica of the application.

    Raises:
        ValueError: the entry is not a valid Serve application (pydantic's message).
    """
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    return get_app_code_version(ServeApplicationSchema.parse_obj(app))



class _Unset:
    """A field absent on one side of a comparison."""

    def __repr__(self) -> str:
        return "(unset)"


#: The ``old``/``new`` of a :class:`Change` for a field that one config does not set.
UNSET = _Unset()


@dataclass(frozen=True)
class Change:
    """One difference between two configs of one application.

    Attributes:
        app: application name.
        field: dotted path inside the application entry (``args.engine_args.max_num_seqs``,
            ``deployments[LLMReplica].user_config.adapters``); empty for ``added``/``removed``.
        kind: ``restart``, ``in_place``, ``added`` or ``removed``.
        old, new: the values (:data:`UNSET` for a field that one side does not set).
        reason: why it has this kind, for people.
    """

    app: str
    field: str
    kind: str
    old: Any
    new: Any
    reason: str

    def __str__(self) -> str:
        verdict = self.kind.replace("_", " ").upper()
        if not self.field:
            return f"{self.app}: {verdict} ({self.reason})"
        return (f"{self.app}: {self.field} {_show(self.old)} -> {_show(self.new)}: "
                f"{verdict} ({self.reason})")


def diff_configs(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Change]]:
    """Compare two Serve configs application by application.

    Args:
        old, new: Serve config dicts (``{"applications": [...]}``), e.g. from
            :func:`load_config`.

    Returns:
        application name -> its changes, for applications that changed, in ``new``'s order
        followed by removed applications. Unchanged applications are left out.
    """
    old_apps, new_apps = _apps_as_served(old), _apps_as_served(new)
    report: dict[str, list[Change]] = {}
    for name, app in new_apps.items():
        if name not in old_apps:
            report[name] = [Change(name, "", ADDED, UNSET, UNSET, "new application; its replicas "
                                   "start, the others are not touched")]
        elif changes := _app_changes(name, old_apps[name], app):
            report[name] = changes
    for name in old_apps:
        if name not in new_apps:
            report[name] = [Change(name, "", REMOVED, UNSET, UNSET, "Serve lets its in-flight "
                                   "requests finish (graceful_shutdown_timeout_s), then stops "
                                   "its replicas")]
    return report


def _apps_as_served(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Application name -> application, with the config's top-level ``logging_config`` as the
    ``logging_config`` of each application that sets none (Serve's rule; the live config
    Serve reports has it written into every application)."""
    default = config.get("logging_config")
    return {a.get("name"): a if a.get("logging_config") is not None or default is None
            else {**a, "logging_config": default} for a in applications(config)}


def restarts(report: dict[str, list[Change]]) -> list[Change]:
    """The changes of a :func:`diff_configs` report that replace replicas."""
    return [c for changes in report.values() for c in changes if c.kind == RESTART]


def format_report(report: dict[str, list[Change]]) -> list[str]:
    """One line per change (see :meth:`Change.__str__`); ``["no changes"]`` for none."""
    return [str(c) for changes in report.values() for c in changes] or ["no changes"]


def _app_changes(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    changes: list[Change] = []
    for key in _keys(old, new):
        if key in ("name", "deployments"):
            continue
        a, b = old.get(key, UNSET), new.get(key, UNSET)
        if key == "args" and isinstance(a, dict) and isinstance(b, dict):
            changes += _args_changes(name, a, b)
        elif key in _APP_RESTART_REASON:
            changes += _leaf_changes(name, key, a, b, RESTART, _APP_RESTART_REASON[key])
        elif key in _APP_IN_PLACE:
            changes += _leaf_changes(name, key, a, b, IN_PLACE,
                                     "lightweight update, replicas keep running")
        else:
            changes += _leaf_changes(name, key, a, b, RESTART, "not a known lightweight "
                                     "option; assume Serve replaces the replicas")
    old_deps = {d.get("name"): d for d in old.get("deployments") or []}
    new_deps = {d.get("name"): d for d in new.get("deployments") or []}
    for dep in _keys(old_deps, new_deps):
        a, b = old_deps.get(dep, {}), new_deps.get(dep, {})
        for key in _keys(a, b):
            if key == "name":
                continue
            field = f"deployments[{dep}].{key}"
            old_value, new_value = a.get(key, UNSET), b.get(key, UNSET)
            if key == "autoscaling_config":
                changes += _autoscaling_changes(name, field, old_value, new_value)
                continue
            if key == "user_config":
                kind, reason = IN_PLACE, "lightweight update: reconfigure() on the running replicas"
            elif key in CODE_VERSION_DEPLOYMENT_OPTIONS:
                kind, reason = RESTART, f"{key}: {_CODE_VERSION}"
            elif key in LIGHTWEIGHT_DEPLOYMENT_OPTIONS:
                kind, reason = IN_PLACE, "lightweight update, replicas keep running"
            else:
                kind, reason = RESTART, f"a {key} change replaces the deployment's replicas"
            changes += _leaf_changes(name, field, old_value, new_value, kind, reason)
    if not any(c.kind == RESTART for c in changes) and _code_version_changed(old, new):
        # Serve's own function is the judge: a code-version input not named above
        changes.append(Change(name, "code version", RESTART, UNSET, UNSET, _CODE_VERSION))
    return changes


#: ``args`` fields whose change says more than "args change" (all restart the application).
_ARGS_REASONS = {
    "engine_args.tensor_parallel_size": "the GPUs a replica spans change: new replicas with "
    "a new placement group (one GPU bundle each) and new engines; release it blue/green",
    "engine_args.pipeline_parallel_size": "the GPUs a replica spans change: new replicas with "
    "a new placement group (one GPU bundle each) and new engines; release it blue/green",
    "model": "a new base model: new replicas fetch and load it; release it blue/green",
    "revision": "another commit of the model: new replicas fetch and load it; release it "
    "blue/green",
}


def _args_changes(app: str, old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """An ``args`` change restarts every replica; some fields say why more precisely."""
    changes = _leaf_changes(app, "args", old, new, RESTART, _APP_RESTART_REASON["args"])
    return [Change(c.app, c.field, c.kind, c.old, c.new,
                   _ARGS_REASONS.get(c.field.removeprefix("args."), c.reason))
            for c in changes]


def _autoscaling_changes(app: str, field: str, old: Any, new: Any) -> list[Change]:
    """An ``autoscaling_config`` change: its ``policy``, or the whole config added or removed
    (the list of policies Serve hashes changes), restarts; its other fields are in place."""
    if isinstance(old, dict) and isinstance(new, dict):
        policy = _leaf_changes(app, f"{field}.policy", old.get("policy", UNSET),
                               new.get("policy", UNSET), RESTART, f"policy: {_CODE_VERSION}")
        rest = _leaf_changes(app, field, {k: v for k, v in old.items() if k != "policy"},
                             {k: v for k, v in new.items() if k != "policy"}, IN_PLACE,
                             "lightweight update, replicas keep running")
        return policy + rest
    return _leaf_changes(app, field, old, new, RESTART,
                         f"an autoscaling_config added or removed: {_CODE_VERSION}")


def _code_version_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    try:
        return code_version(old) != code_version(new)
    except ValueError:  # not a valid Serve application: validation reports it
        return False


def _leaf_changes(app: str, field: str, old: Any, new: Any, kind: str,
                  reason: str) -> list[Change]:
    """Changes between two values, one per differing leaf of nested mappings (lists are
    compared whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for key in _keys(old, new)
                for c in _leaf_changes(app, f"{field}.{key}", old.get(key, UNSET),
                                       new.get(key, UNSET), kind, reason)]
    if old == new:
        return []
    return [Change(app, field, kind, old, new, reason)]


def _keys(a: dict, b: dict) -> list:
    """Keys of ``a`` then the keys only ``b`` has, in order."""
    return list(a) + [k for k in b if k not in a]


def _show(value: Any, limit: int = 80) -> str:
    if value is UNSET:
        return repr(value)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."
