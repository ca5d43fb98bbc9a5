"""``meshctl validate``'s checks of where a variant's replica runs: the Ray resources of its
``LLMReplica`` (``ray_actor_options``, ``placement_group_bundles``,
``placement_group_strategy``), against each other and against its engine.

1. Types and values Ray takes (:func:`resource_option_problems`): every quantity a number
   (``num_gpus: "1"`` is refused here, not by a ``TypeError`` in ``meshctl kuberay``), not a
   boolean, not negative, of at most 4 decimals; custom ``resources`` without ``CPU``,
   ``GPU`` or ``memory``; bundles that are mappings of numbers, none empty; a strategy Ray
   knows; an ``accelerator_type`` Ray knows.
2. The engine's GPUs (:func:`placement_problems`): a replica whose engine spans N GPUs
   (``tensor_parallel_size`` x ``pipeline_parallel_size``) has N bundles with a whole GPU
   free (vLLM's Ray executor puts one worker, on one GPU, in each); a replica on one GPU
   takes at most one (``num_gpus`` 2 with ``tensor_parallel_size`` 1 leaves one idle, 1.5 is
   no GPU count), and a share of one (``num_gpus: 0.5``) only with a
   ``gpu_memory_utilization`` within it (another replica may get the rest of that GPU).
3. The first bundle holds the replica actor (Serve places it there): its CPUs, GPUs,
   memory, custom resources and accelerator share. Serve checks CPUs and GPUs at deploy;
   Ray would wait for memory forever.
4. ``accelerator_type``: a variant that names one is held to it (the actor's options or each
   GPU bundle ask for its resource), and only a replica with GPUs may name one.

Every problem is ``<path.of.field>: <what is wrong>; <how to fix it>``.
"""

from __future__ import annotations

from typing import Any

import yaml

from serve_app.common.deployment_options import (actor_resources, replica_options,
                                                 replica_placement)
from serve_app.common.engine_resources import ACCELERATOR_RESOURCE, engine_need

#: vLLM 0.32's default ``gpu_memory_utilization`` (``vllm/config/cache.py``,
#: ``CacheConfig.gpu_memory_utilization``): an engine that sets none takes this share.
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
#: The quantities of ``ray_actor_options``.
_QUANTITIES = ("num_cpus", "num_gpus", "memory")
#: Where the pod-sizing figures and the bundle shapes are documented.
_DOC = 'docs/gpu-fleet.md, "Pod sizing"'
#: Bundle keys -> the ``ray_actor_options`` field that asks for them.
_ACTOR_FIELD = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


def config_resource_problems(config: dict[str, Any]) -> list[str]:
    """Step 1 of the module docstring for every variant's ``LLMReplica`` entry of a Serve
    config as written, before Ray's schema reads it (which would turn ``num_gpus: "1"`` into
    1 and say nothing, and ``memory: 64Gi`` into "Input should be a valid number")."""
    from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, REPLICA_IMPORT_PATH

    problems = []
    apps = config.get("applications") if isinstance(config, dict) else None
    for i, app in enumerate(apps if isinstance(apps, list) else []):
        if not isinstance(app, dict) or app.get("import_path") != REPLICA_IMPORT_PATH:
            continue
        deps = app.get("deployments")
        for dep in deps if isinstance(deps, list) else []:
            if isinstance(dep, dict) and dep.get("name") == REPLICA_DEPLOYMENT:
                problems += resource_option_problems(
                    dep, f"applications[{i}].deployments[{REPLICA_DEPLOYMENT}]")
    return problems


def resource_option_problems(dep: dict[str, Any] | None, at: str) -> list[str]:
    """Step 1 of the module docstring for one ``LLMReplica`` deployment entry ``dep``
    (``at``: its path)."""
    from ray._common.ray_option_utils import validate_actor_options
    from ray.util.placement_group import VALID_PLACEMENT_GROUP_STRATEGIES

    from serve_app.common.config import gpu_accelerator_types

    dep = dep or {}
    problems = []
    actor = dep.get("ray_actor_options")
    if isinstance(actor, dict):
        for key in _QUANTITIES:
            if key in actor and actor[key] is not None:
                problems += _quantity(actor[key], f"{at}.ray_actor_options.{key}", key)
        resources = actor.get("resources")
        if isinstance(resources, dict):
            for name, value in resources.items():
                where = f"{at}.ray_actor_options.resources.{name}"
                if name in ("CPU", "GPU", "memory"):
                    problems.append(f"{where}: Ray takes {name} from ray_actor_options."
                                    f"{_ACTOR_FIELD[name]}, not from resources; move it there")
                else:
                    problems += _quantity(value, where, name)
        kind = actor.get("accelerator_type")
        if kind is not None and kind not in gpu_accelerator_types():
            problems.append(f"{at}.ray_actor_options.accelerator_type: {kind!r} is not a GPU "
                            "type Ray knows, so no node would ever have it; use one of "
                            f"{', '.join(gpu_accelerator_types())}, or remove it")
        if not problems:
            try:  # Ray's own check of the rest (precision, known keywords)
                validate_actor_options(dict(actor), in_options=False)
            except (TypeError, ValueError) as e:
                problems.append(f"{at}.ray_actor_options: Ray refuses them: {e}")
    bundles = dep.get("placement_group_bundles")
    if isinstance(bundles, list):
        for i, bundle in enumerate(bundles):
            where = f"{at}.placement_group_bundles[{i}]"
            if not isinstance(bundle, dict) or not bundle:
                problems.append(f"{where}: got {bundle!r}; a bundle is a mapping of Ray "
                                "resources to quantities, e.g. {GPU: 1, CPU: 1}")
                continue
            for name, value in bundle.items():
                problems += _quantity(value, f"{where}.{name}", name)
            if all(isinstance(v, (int, float)) and not v for v in bundle.values()):
                problems.append(f"{where}: every quantity is 0; Ray refuses an empty bundle: "
                                "remove it, or give it what one process of the replica uses")
    strategy = dep.get("placement_group_strategy")
    if strategy is not None and strategy not in VALID_PLACEMENT_GROUP_STRATEGIES:
        problems.append(f"{at}.placement_group_strategy: got {strategy!r}; Ray's strategies "
                        f"are {', '.join(sorted(VALID_PLACEMENT_GROUP_STRATEGIES))} (PACK: "
                        "one node when it fits, the mesh's default)")
    return problems


def _quantity(value: Any, where: str, name: str) -> list[str]:
    example = f"{name}: " + {"memory": "68719476736 (bytes: 64 GiB)"}.get(name, "1")
    if isinstance(value, bool):
        return [f"{where}: got {str(value).lower()}; Ray takes a number here, e.g. {example}"]
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return [f"{where}: got {value!r} (a string); Ray takes a number here, "
                    f"e.g. {example}"]
        return [f"{where}: got {value!r} (a string); write the number without quotes, "
                f"e.g. {name}: {value}"]
    if not isinstance(value, (int, float)):
        return [f"{where}: got {value!r} (a {type(value).__name__}); Ray takes a number "
                f"here, e.g. {example}"]
    if value < 0:
        return [f"{where}: got {value!r}; a Ray resource quantity cannot be negative: give "
                "0 or more"]
    if isinstance(value, float) and value and round(value, 4) != value and value < 1:
        return [f"{where}: got {value!r}; Ray counts resources in steps of 0.0001: round "
                "it to 4 decimals"]
    return []


def placement_problems(args, dep: dict[str, Any] | None, at: str) -> list[str]:
    """Steps 2-4 of the module docstring for a variant's valid ``args`` and its
    ``LLMReplica`` deployment entry ``dep`` (whose types passed
    :func:`resource_option_problems`); ``at``: the entry's path."""
    from serve_app.common.deployment_options import replica_resources

    resources = replica_resources(args, dep)
    actor = resources.get("ray_actor_options") or {}
    bundles = resources.get("placement_group_bundles") or []
    problems = []
    if args.gpus_per_replica > 1:
        problems += _spanning_problems(args, actor, bundles, at)
    elif not bundles:
        problems += _one_gpu_problems(args, actor, at)
    if bundles:
        problems += _first_bundle_problems(args, actor, bundles, dep or {}, at)
    problems += _accelerator_problems(args, actor, bundles, at)
    return problems


def _spanning_problems(args, actor: dict, bundles: list[dict], at: str) -> list[str]:
    """A replica whose engine spans N GPUs has N bundles with a whole GPU free."""
    need = args.gpus_per_replica
    taken = actor.get("num_gpus") or 0
    free = [b.get("GPU", 0) - (taken if i == 0 else 0) for i, b in enumerate(bundles)]
    usable = sum(1 for g in free if g >= 1)
    if usable >= need:
        return []
    why = (f"tensor_parallel_size x pipeline_parallel_size = {need}: the engine spans {need} "
           "GPUs")
    if bundles:
        held = sum(b.get("GPU", 0) for b in bundles)
        has = (f"{held:g} GPU(s) in its placement_group_bundles"
               + (f", less the {taken:g} its actor takes (ray_actor_options.num_gpus)"
                  if taken else ""))
        if usable != held - taken:
            has += (f"; {usable} bundle(s) with a whole GPU free, and vLLM runs one worker "
                    "on one GPU in each")
    else:
        has = f"ray_actor_options.num_gpus: {taken:g}"
    return [f"{at}: {why}, and the replica is granted {usable} ({has}). The mesh gives a "
            "replica that spans GPUs a placement group of one GPU bundle each "
            "(docs/gpu-fleet.md): leave num_gpus out of its ray_actor_options and "
            "placement_group_bundles out of the deployment, or lower the parallel sizes"]


def _one_gpu_problems(args, actor: dict, at: str) -> list[str]:
    """An engine on one GPU takes a whole one at most, and a share only with its memory."""
    gpus = actor.get("num_gpus") or 0
    where = f"{at}.ray_actor_options.num_gpus"
    if gpus > 1:
        fix = (f"set tensor_parallel_size: {int(gpus)} in args.engine_args (then remove "
               "num_gpus: the mesh gives the replica one bundle per GPU) or num_gpus: 1"
               if float(gpus).is_integer() else "set num_gpus: 1")
        return [f"{where}: got {gpus:g}, but the engine runs on one GPU "
                "(tensor_parallel_size x pipeline_parallel_size = 1), so the replica would "
                f"hold {gpus:g} and use 1; {fix}"]
    if 0 < gpus < 1 and args.engine == "vllm":
        share = args.engine_args.get("gpu_memory_utilization",
                                     VLLM_DEFAULT_GPU_MEMORY_UTILIZATION)
        if isinstance(share, (int, float)) and not isinstance(share, bool) and share > gpus:
            said = "" if "gpu_memory_utilization" in args.engine_args else \
                " (not set: vLLM's default)"
            return [f"{at.rsplit('.deployments', 1)[0]}.args.engine_args."
                    f"gpu_memory_utilization: {share:g}{said} is over the share of a GPU the "
                    f"replica is granted ({where}: {gpus:g}): Ray may place another replica "
                    "on the rest of that GPU, and the second engine to start finds too little "
                    f"memory; set gpu_memory_utilization to at most {gpus:g}, or num_gpus: 1"]
    return []


def _first_bundle_problems(args, actor: dict, bundles: list[dict], dep: dict,
                           at: str) -> list[str]:
    """The replica actor fits the first bundle of its placement group, field by field."""
    first = bundles[0]
    wants = actor_resources(actor)
    over = [k for k, v in wants.items() if v > first.get(k, 0) + 1e-9]
    if not over:
        return []
    if "placement_group_bundles" in dep:
        whose, fix = "its placement_group_bundles", "or make the first bundle hold it"
    else:
        whose = ("the mesh's placement group, built for the mesh's own actor options "
                 + _flow(replica_options(args)["ray_actor_options"]))
        fix = ("or give the deployment placement_group_bundles whose first bundle holds it: "
               "with these ray_actor_options, placement_group_bundles: "
               + _flow(_bundles_for(args, actor)))
    if "ray_actor_options" not in dep:  # the user wrote the bundles, the mesh the actor
        return [f"{at}.placement_group_bundles[0]: the first bundle holds "
                + ", ".join(_amount(k, first.get(k, 0)) for k in over)
                + ", and the replica actor, which Serve places there, asks for "
                + ", ".join(_amount(k, wants[k]) for k in over)
                + f" (the mesh's ray_actor_options {_flow(actor)}); add it to the first "
                  f"bundle, or set ray_actor_options ({_DOC})"]
    problems = []
    for key in over:
        field = _ACTOR_FIELD.get(key)
        if field is None and key.startswith(ACCELERATOR_RESOURCE.format("")):
            field = "accelerator_type"
        field = field or f"resources.{key}"
        problems.append(
            f"{at}.ray_actor_options.{field}: the replica actor asks for "
            f"{_amount(key, wants[key])}, over the {_amount(key, first.get(key, 0))} of the "
            f"first bundle of {whose}: {_flow(first)}. Serve places the actor in that bundle, "
            f"so Ray would never start it; ask for less, {fix} ({_DOC})")
    return problems


def _amount(key: str, value: float) -> str:
    """A quantity of a Ray resource for a message: ``memory 68719476736 bytes (64 GiB)``,
    ``CPU 8``."""
    if key == "memory":
        return f"memory {value:.0f} bytes ({value / 2**30:.3g} GiB)"
    return f"{key} {value:g}"


def _accelerator_problems(args, actor: dict, bundles: list[dict], at: str) -> list[str]:
    """An accelerator type needs GPUs, and a variant's is asked for where Ray places it."""
    kind = args.accelerator_type
    gpus = sum(b.get("GPU", 0) for b in bundles) if bundles else (actor.get("num_gpus") or 0)
    args_at = f"{at.rsplit('.deployments', 1)[0]}.args.accelerator_type"
    if not gpus:
        named = [w for w, k in ((args_at, kind),
                                (f"{at}.ray_actor_options.accelerator_type",
                                 actor.get("accelerator_type"))) if k]
        return [f"{where}: the replica holds no GPU, and an accelerator type is a GPU's; give "
                "it one (ray_actor_options: {num_cpus: 2, num_gpus: 1, accelerator_type: "
                f"{kind or actor.get('accelerator_type')}}}, or remove ray_actor_options to "
                "take the mesh's) or remove the accelerator type" for where in named]
    if not kind:
        return []
    resource = ACCELERATOR_RESOURCE.format(kind)
    if bundles:
        bare = [i for i, b in enumerate(bundles) if b.get("GPU", 0) and not b.get(resource)]
        return [f"{at}.placement_group_bundles[{i}]: args.accelerator_type is {kind}, but "
                f"this GPU bundle does not ask for {resource!r}, so Ray may place it on any "
                f"GPU; add '{resource}': 0.001 to it, as the mesh's bundles do" for i in bare]
    if actor.get("accelerator_type") != kind:
        got = actor.get("accelerator_type")
        return [f"{at}.ray_actor_options.accelerator_type: args.accelerator_type is {kind}, "
                + (f"but these options ask for {got}" if got else
                   "but these options (which replace the mesh's) do not ask for it, so Ray "
                   "may place the replica on any GPU")
                + f"; set ray_actor_options.accelerator_type: {kind}"]
    return []


def _bundles_for(args, actor: dict) -> list[dict]:
    """The bundles of the mesh's shape that hold ``actor``."""
    need = engine_need(args, args.gpus_per_replica, cached=False)
    return replica_placement(need, actor, args.accelerator_type)["placement_group_bundles"]


def _flow(value: Any) -> str:
    """``value`` as one line of YAML flow style (what a user would paste into a config)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False)
    return text.strip()
