"""Validate a Serve config of the mesh before ``serve deploy``.

Checks, each reported as ``<path.of.field>: <problem>``:

1. Ray Serve's own schema (``ServeDeploySchema``): structure, unique application names and
   route prefixes, route prefix format.
2. The router application (``import_path: serve_app.router:build_app``): exactly one; its
   ``MeshRouter`` ``user_config`` against :class:`RouterConfig` (weights >= 0 with a positive
   sum per route, no duplicate variants).
3. Each variant application (``import_path: serve_app.replica:build_app``): ``args`` against
   :class:`VariantArgs`, ``LLMReplica`` ``user_config`` against :class:`ReplicaConfig`, not
   exposed over HTTP (``route_prefix: null``).
4. Cross-references: every variant a route names is a variant application in the same
   config, and serves the route's name (``args.served_model_name``).

The router's and replica's ``reconfigure()`` run the same pydantic models at run time.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from serve_app.config import ReplicaConfig, RouterConfig, VariantArgs, format_validation_error
from serve_app.serve_configs import (
    REPLICA_DEPLOYMENT,
    ROUTER_DEPLOYMENT,
    ROUTER_IMPORT_PATH,
    applications,
    deployment,
    mesh_parts,
)


def validate_config(config: dict[str, Any]) -> list[str]:
    """All problems found in a Serve config dict; an empty list means it is valid."""
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        return [format_validation_error(e)]

    problems: list[str] = []
    apps = applications(config)
    routers = [i for i, a in enumerate(apps) if a.get("import_path") == ROUTER_IMPORT_PATH]
    if len(routers) != 1:
        return [f"applications: need exactly one router application (import_path: "
                f"{ROUTER_IMPORT_PATH}), found {len(routers)}"]
    parts = mesh_parts(config)

    router_at = f"applications[{routers[0]}]"
    prefix = parts.router_app.get("route_prefix", "/")
    if not isinstance(prefix, str) or not prefix.startswith("/") or (
            prefix != "/" and prefix.endswith("/")):
        problems.append(f"{router_at}.route_prefix: got {prefix!r}; the router needs a route "
                        "prefix that starts with '/' and does not end with '/' (usually '/')")
    router_config = _check(problems, RouterConfig, parts.router_user_config,
                           f"{router_at}.deployments[{ROUTER_DEPLOYMENT}].user_config")

    variant_args: dict[str, VariantArgs] = {}
    for name, app in parts.variant_apps.items():
        at = f"applications[{parts.app_index[name]}]"
        args = _check(problems, VariantArgs, app.get("args") or {}, f"{at}.args")
        if args:
            variant_args[name] = args
        dep = deployment(app, REPLICA_DEPLOYMENT)
        if dep and dep.get("user_config") is not None:
            _check(problems, ReplicaConfig, dep["user_config"],
                   f"{at}.deployments[{REPLICA_DEPLOYMENT}].user_config")
        if app.get("route_prefix", "/") is not None:
            problems.append(f"{at}.route_prefix: variant {name!r} must not be exposed over HTTP; "
                            "set `route_prefix: null` (clients go through the router)")

    if router_config:
        for route, rc in router_config.routes.items():
            for i, v in enumerate(rc.variants):
                at = (f"{router_at}.deployments[{ROUTER_DEPLOYMENT}].user_config.routes."
                      f"{route}.variants[{i}].application")
                if v.application not in parts.variant_apps:
                    problems.append(f"{at}: no variant application named {v.application!r} in "
                                    "this config; add it or remove it from the route")
                elif (args := variant_args.get(v.application)) and args.served_model_name != route:
                    problems.append(f"{at}: {v.application!r} serves "
                                    f"{args.served_model_name!r}; set its args.served_model_name "
                                    f"to {route!r}")
    return problems


def _check(problems: list[str], model: type[BaseModel], data: Any, at: str):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems.append(format_validation_error(e, at))
        return None
