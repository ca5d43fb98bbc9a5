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
   config, and serves the route's name (``args.served_model_name``); every adapter a variant
   declares is in the adapter registry, trained for the variant's base model, with a rank
   that fits ``max_lora_rank``, on an engine with ``enable_lora``; every adapter version a
   route's adapter split names is declared by a variant of the route; every adapter a tenant
   owns is declared by a variant of a route the tenant may call.
5. Where weights come from: a variant's ``args.model`` and an adapter's ``uri`` parse as a
   source (:mod:`serve_app.common.sources`: a hub id of the right shape pinned to a commit, a
   bucket URI with a bucket and a folder); a local model directory exists here (with its
   ``config.json``), and a local adapter's files pass the checks a replica runs
   (:func:`~serve_app.common.adapters.verify_adapter`: no pickled weights, the SHA-256 of its
   weights as registered). Remote sources are fetched when a replica starts, not here.
6. Token budgets: a tenant's ``tokens_per_minute`` and ``tokens_per_day`` hold at least the
   smallest request (:func:`smallest_request` with ``max_tokens`` 1), else every request is
   refused. :func:`config_warnings` also warns about a budget below one chat without
   ``max_tokens`` on a route the tenant may call, sized from the route's ``max_model_len``
   (:func:`context_length`): every such chat would be refused.
7. Where a replica runs (:mod:`serve_app.release.placement_check`): its
   ``ray_actor_options`` and ``placement_group_bundles`` are numbers Ray takes; a replica
   whose engine spans GPUs (``tensor_parallel_size`` x ``pipeline_parallel_size`` > 1) has
   that many GPU bundles, one on one GPU holds one (or a share with the memory to match);
   its actor fits the first bundle of its placement group (CPUs, GPUs, memory, custom
   resources); an ``accelerator_type`` is Ray's, on a replica with GPUs, and asked for.

vLLM's own checks of the engine args (names and values) are in
:mod:`serve_app.release.engine_check` (slower: it imports vLLM); ``meshctl validate`` runs both.
The router's and replica's ``reconfigure()`` run the same pydantic models at run time.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from pydantic import BaseModel, ValidationError

from serve_app.common.adapters import (AdapterError, adapter_key, adapter_name, fit_problem,
                                       load_manifest, manifest_file, merged_adapter,
                                       verify_adapter)
from serve_app.common.config import ReplicaConfig, RouterConfig, VariantArgs
from serve_app.common.deployment_options import SURGE_PERCENT
from serve_app.common.errors import format_validation_error
from serve_app.common.serve_configs import (
    REPLICA_DEPLOYMENT,
    ROUTER_DEPLOYMENT,
    ROUTER_IMPORT_PATH,
    applications,
    deployment,
    mesh_parts,
)
from serve_app.common.paths import models_dir, resolve_model_path
from serve_app.common.sources import parse_source
from serve_app.release.placement_check import config_resource_problems, placement_problems
from serve_app.tenancy.token_budget import Reservation

#: The keys of a model's ``config.json`` (or its ``text_config``) that vLLM derives
#: ``max_model_len`` from, the smallest one set winning (vLLM 0.32,
#: ``ModelArchConfigConvertor.derive_max_model_len_and_key``).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")


def smallest_request(max_model_len: int, max_tokens: int | None = None) -> Reservation:
    """What the smallest chat reserves on a route of ``max_model_len`` tokens (0: not known):
    one empty user message, with ``max_tokens`` or, when None, without it (then vLLM may
    generate the rest of the context, and the router reserves ``max_model_len``).
    A token budget below it refuses every such request with 400
    ``reservation_exceeds_budget``."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": ""}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return Reservation.of("chat", body, max_model_len)


def context_length(args: VariantArgs) -> int:
    """The ``max_model_len`` a variant's engine will report, tokens: its
    ``engine_args.max_model_len``, else what vLLM derives from the local model's
    ``config.json`` (:data:`CONTEXT_KEYS`); 0 when it cannot be known here (a model from the
    hub or a bucket, or no model directory)."""
    given = args.engine_args.get("max_model_len")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given
    if parse_source(args.model, args.revision).remote:
        return 0
    try:
        with open(f"{resolve_model_path(args.model)}/config.json") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return 0
    if not isinstance(config, dict):
        return 0
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = [v for k in CONTEXT_KEYS if isinstance(v := text.get(k), int) and v > 0]
    if isinstance(text.get("model_max_length"), int) and text["model_max_length"] > 0:
        return text["model_max_length"]  # vLLM: it overrides the others (Command-R)
    return min(found, default=0)


def route_context_lengths(router: RouterConfig,
                          variant_args: dict[str, VariantArgs]) -> dict[str, tuple[int, str]]:
    """Route -> (its ``max_model_len``, the variant it comes from): the largest of its
    variants', as the router reserves by the largest its variants report
    (:meth:`~serve_app.variants.registry.VariantRegistry.context_len`); routes with none
    known are left out."""
    out = {}
    for route, rc in router.routes.items():
        lengths = [(context_length(variant_args[v.application]), v.application)
                   for v in rc.variants if v.application in variant_args]
        best = max(lengths, default=(0, ""))
        if best[0]:
            out[route] = best
    return out


def config_warnings(config: dict[str, Any]) -> list[str]:
    """What is valid but risky in a Serve config, one line each (``meshctl validate`` prints
    these and still exits 0). ``config`` is one :func:`validate_config` found valid."""
    warnings = []
    parts = mesh_parts(config)
    warnings += _budget_warnings(config)
    for name, app in parts.variant_apps.items():
        if (app.get("args") or {}).get("engine") == "sim":
            warnings.append(
                f"applications[{parts.app_index[name]}].args.engine: variant {name!r} runs the "
                "simulated engine: its answers are made up and its time follows a profile "
                "(tests and scale benchmarks only); remove `engine: sim` to serve real answers")
        dep = deployment(app, REPLICA_DEPLOYMENT) or {}
        surge = dep.get("max_surge_percent", SURGE_PERCENT)
        if not surge:
            warnings.append(
                f"applications[{parts.app_index[name]}].deployments[{REPLICA_DEPLOYMENT}]."
                f"max_surge_percent: variant {name!r} runs without surge replacement: a change "
                "of its args stops its replica before the new one is up, and a bad one leaves "
                f"it with none; set max_surge_percent: {SURGE_PERCENT}")
    return warnings


def _replica_router_problems(dep: dict[str, Any] | None, at: str) -> list[str]:
    """The mesh's AffinityRouter keywords (Serve itself checks only that they are JSON). A
    custom replica router runs under either ingress: ``LLMReplica`` is not its application's
    ingress deployment (:mod:`serve_app.variant_ingress`)."""
    from serve_app.replica_routing.router import AFFINITY_ROUTER, affinity_settings

    rr = (dep or {}).get("request_router_config") or {}
    if rr.get("request_router_class") != AFFINITY_ROUTER:
        return []
    try:
        affinity_settings(rr.get("request_router_kwargs") or {})
    except ValueError as e:
        return [f"{at}.request_router_kwargs: {e}"]
    return []


def validate_config(config: dict[str, Any]) -> list[str]:
    """All problems found in a Serve config dict (checks 1-7 of the module docstring); an
    empty list means it is valid. Engine args are vLLM's to
    judge: :func:`serve_app.release.engine_check.engine_problems`."""
    from ray.serve.schema import ServeDeploySchema

    if typed := config_resource_problems(config):  # before Ray's schema coerces them
        return typed
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        return [format_validation_error(e, data=config)]

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
    variant_adapters: dict[str, set[str]] = {}  # application -> declared "name@vN"
    replicas_valid = True  # else tenants' adapters are not checked against variant_adapters
    no_model: set[str] = set()  # variants whose model directory is not here
    for name, app in parts.variant_apps.items():
        at = f"applications[{parts.app_index[name]}]"
        args = _check(problems, VariantArgs, app.get("args") or {}, f"{at}.args")
        if args and (missing := _model_problem(args)):
            problems.append(f"{at}.args.model: {missing}")
            no_model.add(name)
        if args:
            variant_args[name] = args
        dep = deployment(app, REPLICA_DEPLOYMENT)
        if args:
            problems += placement_problems(args, dep, f"{at}.deployments[{REPLICA_DEPLOYMENT}]")
        if dep and dep.get("user_config") is not None:
            uc_at = f"{at}.deployments[{REPLICA_DEPLOYMENT}].user_config"
            replica = _check(problems, ReplicaConfig, dep["user_config"], uc_at)
            if replica:
                variant_adapters[name] = {a.key for a in replica.adapters}
            else:
                replicas_valid = False
            if replica and args:
                problems += _adapter_problems(replica, args, uc_at)
        problems += _replica_router_problems(
            dep, f"{at}.deployments[{REPLICA_DEPLOYMENT}].request_router_config")
        if app.get("route_prefix", "/") is not None:
            problems.append(f"{at}.route_prefix: variant {name!r} must not be exposed over HTTP; "
                            "set `route_prefix: null` (clients go through the router)")

    if router_config:
        problems += _tenant_problems(router_config, variant_adapters if replicas_valid else None,
                                     f"{router_at}.deployments[{ROUTER_DEPLOYMENT}].user_config")
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
            if rc.shadow is not None:
                at = (f"{router_at}.deployments[{ROUTER_DEPLOYMENT}].user_config.routes."
                      f"{route}.shadow.application")
                shadow = rc.shadow.application
                if shadow not in parts.variant_apps:
                    problems.append(f"{at}: no variant application named {shadow!r} in this "
                                    "config; add it (it may serve no traffic: weight 0 or no "
                                    "route) or remove the shadow")
                elif (args := variant_args.get(shadow)) and args.served_model_name != route:
                    problems.append(f"{at}: {shadow!r} serves {args.served_model_name!r}, not "
                                    f"route {route!r}; a shadow must answer the same requests: "
                                    f"set its args.served_model_name to {route!r}")
            for adapter, merged in rc.merged.items():
                at = (f"{router_at}.deployments[{ROUTER_DEPLOYMENT}].user_config.routes."
                      f"{route}.merged.{adapter}")
                if merged not in no_model:  # its stamp cannot be read: reported above
                    problems += _merged_problems(adapter, merged, route, variant_args, at)
            declared = set().union(*(variant_adapters.get(v.application, set())
                                     for v in rc.variants))
            for name, split in rc.adapters.items():
                for i, v in enumerate(split.versions):
                    if (key := adapter_key(name, v.version)) not in declared:
                        problems.append(
                            f"{router_at}.deployments[{ROUTER_DEPLOYMENT}].user_config.routes."
                            f"{route}.adapters.{name}.versions[{i}]: {key} is not "
                            f"served by any variant of route {route!r}; add {{name: {name}, "
                            f"version: {v.version}}} to a variant's LLMReplica "
                            "user_config.adapters")
    return problems


def _model_problem(args: VariantArgs) -> str | None:
    """Why a variant's local ``args.model`` cannot be served from this host, or None (a
    model from the hub or a bucket is fetched by the replica: nothing to look at here)."""
    if parse_source(args.model, args.revision).remote:
        return None
    try:
        resolve_model_path(args.model)
    except FileNotFoundError as e:
        here = sorted(p.parent.name for p in models_dir().glob("*/config.json"))
        return f"{e} Models in {models_dir()}: {', '.join(here) or 'none'}."
    return None


def _tenant_problems(router: RouterConfig, variant_adapters: dict[str, set[str]] | None,
                     at: str) -> list[str]:
    """Tenants own adapters that a variant of their routes declares, and token budgets
    that hold the smallest request."""
    problems = []
    for i, tenant in enumerate(router.tenants):
        problems += _budget_problems(tenant, f"{at}.tenants[{i}]")
        if variant_adapters is None:
            continue
        routes = [r for name, r in router.routes.items() if tenant.may_call(name)]
        declared = sorted({adapter_name(key) for r in routes for v in r.variants
                           for key in variant_adapters.get(v.application, ())})
        for j, adapter in enumerate(tenant.adapters):
            if adapter not in declared:
                close = difflib.get_close_matches(adapter, declared, n=1, cutoff=0.6)
                problems.append(
                    f"{at}.tenants[{i}].adapters[{j}]: {adapter!r} is declared by no variant "
                    f"of the routes tenant {tenant.id!r} may call (declared: "
                    f"{', '.join(declared) or 'none'}); "
                    + (f"did you mean {close[0]!r}? " if close else "")
                    + "fix the name, or declare the adapter in a variant's LLMReplica "
                      "user_config.adapters")
    return problems


#: Where the reservation of a request is stated (generated from the code).
RESERVATION_DOC = 'docs/errors.md, "What a request reserves"'


def _budget_problems(tenant, at: str) -> list[str]:
    """A budget below the smallest request of all (an empty chat, ``max_tokens`` 1) can
    serve nothing."""
    least = smallest_request(0, max_tokens=1)
    problems = []
    for budget in ("tokens_per_minute", "tokens_per_day"):
        limit = getattr(tenant, budget)
        if limit is not None and limit < least.total:
            problems.append(f"{at}.{budget}: {limit} is below the smallest request "
                            f"({least.total} tokens: a chat of one empty message reserves a "
                            f"prompt bound of {least.prompt}, plus max_tokens 1), so tenant "
                            f"{tenant.id!r} would get 400 reservation_exceeds_budget for every "
                            f"request; set at least {least.total} ({RESERVATION_DOC})")
    return problems


def _budget_warnings(config: dict[str, Any]) -> list[str]:
    """Budgets that refuse every chat without ``max_tokens`` on a route the tenant may call:
    such a chat reserves its prompt bound plus the route's whole ``max_model_len``."""
    parts = mesh_parts(config)
    routers = [i for i, a in enumerate(applications(config))
               if a.get("import_path") == ROUTER_IMPORT_PATH]
    try:
        router = RouterConfig.model_validate(parts.router_user_config or {})
        variant_args = {name: VariantArgs.model_validate(app.get("args") or {})
                        for name, app in parts.variant_apps.items()}
    except ValidationError:
        return []  # validate_config reports it
    lengths = route_context_lengths(router, variant_args)
    at = f"applications[{routers[0]}].deployments[{ROUTER_DEPLOYMENT}].user_config.tenants"
    warnings = []
    for i, tenant in enumerate(router.tenants):
        for budget in ("tokens_per_minute", "tokens_per_day"):
            limit = getattr(tenant, budget)
            for route, (length, variant) in lengths.items():
                need = smallest_request(length)
                if limit is None or limit >= need.total or not tenant.may_call(route):
                    continue
                warnings.append(
                    f"{at}[{i}].{budget}: {limit} cannot hold one chat without max_tokens on "
                    f"route {route!r} ({need.total} tokens: its prompt bound, at least "
                    f"{need.prompt}, plus the route's max_model_len {length} ({variant!r}), "
                    "as vLLM may generate the rest of the context), so tenant "
                    f"{tenant.id!r} gets 400 reservation_exceeds_budget for every chat to "
                    f"{route!r} that sets no max_tokens; set {budget} to at least "
                    f"{need.total}, or have its clients always set max_tokens "
                    f"({RESERVATION_DOC})")
    return warnings


def _merged_problems(adapter: str, merged: str, route: str,
                     variant_args: dict[str, VariantArgs], at: str) -> list[str]:
    """A route's merged variant must be in the config, answer as the route, and run a model
    that has a version of ``adapter`` merged in (its ``mesh_model_stamp.json``)."""
    args = variant_args.get(merged)
    if args is None:
        return [f"{at}: no variant application named {merged!r} in this config; add it (a "
                "variant whose model has the adapter merged in) or remove the entry"]
    if args.served_model_name != route:
        return [f"{at}: {merged!r} serves {args.served_model_name!r}; set its "
                f"args.served_model_name to {route!r}"]
    held = merged_adapter(args.model)
    if held is None or adapter_name(held) != adapter:
        return [f"{at}: the model {args.model!r} of {merged!r} has "
                f"{held or 'no adapter'} merged in, not {adapter!r}; build one with "
                f"scripts/prepare_model.py --merge-adapter {adapter}@vN --out models/<name>"]
    return []


def _adapter_problems(replica: ReplicaConfig, args: VariantArgs, at: str) -> list[str]:
    """Declared adapters must be registered, trained for this variant's model, and fit its
    LoRA settings (the replica re-checks files and checksums when it loads them)."""
    if not replica.adapters:
        return []
    engine = args.engine_args
    try:
        registry = load_manifest(manifest_file(replica.adapters_manifest))
    except AdapterError as e:
        return [f"{at}.adapters_manifest: {e}"]
    problems = []
    # vLLM's default max_lora_rank is 16; 0 stands for LoRA off.
    max_rank = engine.get("max_lora_rank", 16) if engine.get("enable_lora") else 0
    # vLLM's max_cpu_loras defaults to max_loras (default 1)
    max_cpu_loras = engine.get("max_cpu_loras") or engine.get("max_loras", 1)
    if max_rank and (replica.max_adapters_per_replica or 0) > max_cpu_loras:
        problems.append(f"{at}.max_adapters_per_replica: {replica.max_adapters_per_replica} is "
                        f"over the engine's max_cpu_loras={max_cpu_loras}; raise "
                        "args.engine_args.max_cpu_loras (an args change: new replicas) or "
                        "lower max_adapters_per_replica")
    for i, ref in enumerate(replica.adapters):
        spec = registry.get(ref.key)
        if spec is None:
            problems.append(f"{at}.adapters[{i}]: {ref.key} is not in the adapter registry")
        elif problem := fit_problem(spec, base_model=args.model, max_lora_rank=max_rank,
                                    base_revision=args.revision):
            problems.append(f"{at}.adapters[{i}]: {spec.key} cannot be served: {problem}")
        else:  # the files, as the replica checks them before a load
            try:
                verify_adapter(spec, base_model=args.model, max_lora_rank=max_rank,
                               base_revision=args.revision)
            except AdapterError as e:
                problems.append(f"{at}.adapters[{i}]: {e}")
    return problems


def _check(problems: list[str], model: type[BaseModel], data: Any, at: str):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems.append(format_validation_error(e, at, data))
        return None
