"""The Serve deployment options of the mesh's three deployments, in one table.

The deployment classes (``LLMReplica``, ``MeshRouter``, ``RolloutController``) are plain
classes; these options are applied where each application is built (``build_app``, as Ray
Serve LLM's ``builder.py`` does), and ``meshctl validate`` and ``meshctl kuberay`` read the
same table. A Serve config's ``deployments:`` entry overrides any of them (Serve's rule;
``ray_actor_options`` given in a config replace these whole).
"""

from __future__ import annotations

from typing import Any

from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, ROUTER_DEPLOYMENT, deployment

#: ``max_surge_percent`` of every ``LLMReplica`` (the shipped configs state it too): Serve
#: starts a replacement before it stops the replica it replaces, so a changed ``args`` or a
#: bad deploy never leaves a variant with no replica (a failed replacement leaves the old
#: one serving). ``meshctl validate`` warns when a config sets it to 0.
SURGE_PERCENT = 100

#: Ray resources of one ``LLMReplica`` when the config gives no ``ray_actor_options``. Small
#: enough for two variants and the router on a 2-core host; GPU hosts set
#: ``{num_cpus: 1, num_gpus: 1}`` in the config. ``meshctl kuberay`` sizes worker pods from it.
REPLICA_ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0.5}


def replica_environment(app: dict[str, Any]) -> dict[str, str]:
    """The environment a variant application's replica runs its engine with, to run the same
    engine outside Ray (a benchmark's vLLM server, the profile's calibration): the
    application's ``runtime_env.env_vars``, and ``OMP_NUM_THREADS`` as Ray sets it for the
    replica's actor when they leave it out: its ``num_cpus`` rounded down, at least 1
    (``ray._private.utils.set_omp_num_threads_if_unset``). With the shipped configs'
    ``VLLM_CPU_OMP_THREADS_BIND: nobind``, vLLM computes with that many threads."""
    env = {k: str(v) for k, v in ((app.get("runtime_env") or {}).get("env_vars") or {}).items()}
    options = ((deployment(app, REPLICA_DEPLOYMENT) or {}).get("ray_actor_options")
               or REPLICA_ACTOR_OPTIONS)
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(options.get("num_cpus", 1)))))
    return env


#: Serve's own default ``num_replicas`` (a config without one runs this many).
DEFAULT_NUM_REPLICAS = 1

REPLICA_OPTIONS: dict[str, Any] = dict(
    name=REPLICA_DEPLOYMENT,
    num_replicas=DEFAULT_NUM_REPLICAS,
    # A full generation must fit: max_tokens at ~30 tokens/s on CPU, with headroom.
    graceful_shutdown_timeout_s=300,
    graceful_shutdown_wait_loop_s=1,
    health_check_period_s=2,  # three failures in a row (a dead engine) replace it in ~6 s
    health_check_timeout_s=60,
    # The router admits at most max_num_seqs requests per replica (serve_app.admission.variant_queue);
    # these are Serve's own bounds behind it: requests past them fail over at once
    # (BackPressureError) instead of queueing without end.
    max_ongoing_requests=64,
    max_queued_requests=64,
    max_surge_percent=SURGE_PERCENT,
    ray_actor_options=REPLICA_ACTOR_OPTIONS,
)

ROUTER_OPTIONS: dict[str, Any] = dict(
    name=ROUTER_DEPLOYMENT,
    graceful_shutdown_timeout_s=300,  # streams in flight finish on a router being replaced
    max_ongoing_requests=1000,  # the router's own admission queues bound the work
    ray_actor_options={"num_cpus": 0.25},
)

CONTROLLER_OPTIONS: dict[str, Any] = dict(
    name="RolloutController",
    num_replicas=1,  # the one holder of every rollout's state
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
)


#: Ray resources of the actor of a replica that spans GPUs: Ray Serve LLM's replica actor
#: (one CPU, no GPU: its engine's workers hold the GPUs, one bundle each). The first bundle
#: holds more than it asks for: its engine core's CPU and both processes' memory.
SPANNING_ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 1}
#: Placement strategy of a spanning replica's bundles, Ray Serve LLM's default: on one node
#: when it fits, else across nodes.
PLACEMENT_STRATEGY = "PACK"


def replica_placement(need, actor: dict[str, Any],
                      accelerator_type: str | None = None) -> dict[str, Any]:
    """``placement_group_bundles`` and ``placement_group_strategy`` of a replica whose engine
    spans ``need.gpus`` GPUs, as Ray Serve LLM builds them (Ray 2.60,
    ``ray/llm/_internal/serve/core/server/llm_server.py``: ``get_deployment_options`` and
    ``_merge_replica_actor_and_child_actor_bundles``): one bundle per GPU worker
    (:meth:`~serve_app.common.engine_resources.EngineNeed.worker_bundle`: its GPU, its CPU,
    its memory and the accelerator's resource), the first one also holding the replica
    actor, since Serve places the actor in the first bundle: what its ``ray_actor_options``
    ask for (``actor``), and at least what the actor and vLLM's engine core use
    (:meth:`~serve_app.common.engine_resources.EngineNeed.actor_share`). vLLM's Ray
    executor puts one worker on each GPU bundle.

    Args:
        need: the replica's :class:`~serve_app.common.engine_resources.EngineNeed`.
        actor: the replica actor's ``ray_actor_options`` (``num_cpus``, ``num_gpus``,
            ``memory``, ``resources``, ``accelerator_type``).
        accelerator_type: the variant's ``args.accelerator_type``.
    """
    bundles = [need.worker_bundle(accelerator_type) for _ in range(need.gpus)]
    asks, share = actor_resources(actor), need.actor_share()
    bundles[0] = merge_bundle(bundles[0], {k: max(asks.get(k, 0), share.get(k, 0))
                                           for k in [*asks, *share]})
    return {"placement_group_bundles": bundles, "placement_group_strategy": PLACEMENT_STRATEGY}


def actor_resources(actor: dict[str, Any]) -> dict[str, float]:
    """The Ray resources a replica actor's ``ray_actor_options`` ask for, as bundle keys:
    ``CPU`` (Serve's default 1 when ``num_cpus`` is absent), ``GPU``, ``memory``, custom
    ``resources`` and the ``accelerator_type:<type>`` share an ``accelerator_type`` takes
    (Ray's rule, ``ray._private.utils.resources_from_ray_options``). Values must be numbers
    (``meshctl validate`` checks them first)."""
    from serve_app.common.engine_resources import ACCELERATOR_RESOURCE, ACCELERATOR_SHARE

    own = {"CPU": actor.get("num_cpus", 1), "GPU": actor.get("num_gpus") or 0,
           **(actor.get("resources") or {})}
    if actor.get("memory"):
        own["memory"] = actor["memory"]
    if actor.get("accelerator_type"):
        own[ACCELERATOR_RESOURCE.format(actor["accelerator_type"])] = ACCELERATOR_SHARE
    return {k: v for k, v in own.items() if v}


def merge_bundle(bundle: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """``bundle`` plus ``more``, key by key (whole numbers kept whole)."""
    merged = {k: bundle.get(k, 0) + more.get(k, 0) for k in [*bundle, *more]}
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in merged.items()
            if v or k == "GPU"}


def replica_options(args) -> dict[str, Any]:
    """The Serve options ``build_app`` deploys a variant's ``LLMReplica`` with
    (:data:`REPLICA_OPTIONS`), for its :class:`~serve_app.common.config.VariantArgs`:

    - a replica whose engine spans GPUs (``args.gpus_per_replica`` > 1): the actor options
      :data:`SPANNING_ACTOR_OPTIONS`, and a placement group of one bundle per GPU worker,
      the first also holding the actor and its engine core (:func:`replica_placement`),
      sized by :func:`~serve_app.common.engine_resources.engine_need`;
    - a replica on one GPU of a variant with an ``accelerator_type``: ``num_gpus: 1``, that
      ``accelerator_type``, and the CPUs and memory its engine needs;
    - else (CPUs; or a GPU the config's ``ray_actor_options`` give): :data:`REPLICA_OPTIONS`.

    The memory counts the weights' bytes as a local folder or the model's name give them
    (``cached=False``), so every node that builds the application gets the same options. A
    Serve config's ``deployments:`` entry still overrides any of them (``meshctl validate``
    checks the result: :func:`replica_resources`)."""
    from serve_app.common.engine_resources import engine_need

    opts = options(REPLICA_OPTIONS)
    gpus = args.gpus_per_replica
    if gpus > 1:
        need = engine_need(args, gpus, cached=False)
        opts["ray_actor_options"] = dict(SPANNING_ACTOR_OPTIONS)
        opts.update(replica_placement(need, SPANNING_ACTOR_OPTIONS, args.accelerator_type))
    elif args.accelerator_type:
        need = engine_need(args, 1, cached=False)
        actor: dict[str, Any] = {"num_cpus": need.cpus, "num_gpus": 1}
        if need.memory:
            actor["memory"] = need.memory
        actor["accelerator_type"] = args.accelerator_type
        opts["ray_actor_options"] = actor
    return opts


def replica_resources(args, dep: dict[str, Any] | None) -> dict[str, Any]:
    """The options Serve runs a variant's replica with: :func:`replica_options` of its
    ``args``, overridden by its Serve config ``deployments:`` entry ``dep`` (Serve's rule: a
    given option replaces the code's whole). Only the resource options are returned:
    ``ray_actor_options`` and, when it has a placement group, ``placement_group_bundles``
    and ``placement_group_strategy``."""
    code = replica_options(args)
    dep = dep or {}
    keys = ("ray_actor_options", "placement_group_bundles", "placement_group_strategy")
    return {k: dep[k] if k in dep else code[k] for k in keys if k in dep or k in code}


def granted_gpus(resources: dict[str, Any]) -> float:
    """GPUs a replica's engine is granted by :func:`replica_resources`: those of its
    placement group's bundles less what the replica actor itself takes (it sits in the
    first bundle), or, without a placement group, the actor's ``num_gpus``."""
    actor = resources.get("ray_actor_options") or {}
    bundles = resources.get("placement_group_bundles")
    if bundles:
        return sum(_number(b.get("GPU")) for b in bundles) - _number(actor.get("num_gpus"))
    return _number(actor.get("num_gpus"))


def _number(value: Any) -> float:
    """A resource quantity as Ray reads it; 0 for one that is absent or not a number (which
    ``meshctl validate`` refuses, naming it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    return value


def options(table: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``table`` for ``serve.deployment(cls, **options(table))``, so Serve never
    holds (or changes) the table's own dicts."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
