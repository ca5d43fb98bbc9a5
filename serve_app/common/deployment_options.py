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
    # The router admits at most max_num_seqs requests per replica (serve_app.ingress.admission);
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


def options(table: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``table`` for ``serve.deployment(cls, **options(table))``, so Serve never
    holds (or changes) the table's own dicts."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
