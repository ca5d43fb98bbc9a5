"""The worker groups of a KubeRay ``RayService`` (``meshctl kuberay``), sized from a Serve
config, and Kubernetes memory quantities.

Each ``LLMReplica`` replica gets a Ray worker pod sized from the resources Serve runs it with
(:func:`~serve_app.common.deployment_options.replica_resources`: the config's
``ray_actor_options``, or the mesh's; for a replica that spans GPUs, its placement group's
bundles, summed, so the whole group fits one pod), raised for a GPU replica to what its
engine runs beside the GPUs (:func:`~serve_app.common.engine_resources.engine_need`: the
actor, vLLM's engine core and one worker per GPU, the weights' bytes); variants of one
resource shape (GPUs, accelerator type, custom resource names) share a group.
:mod:`serve_app.release.kuberay` writes the manifest around them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from serve_app.common.config import VariantArgs
from serve_app.common.deployment_options import (REPLICA_OPTIONS, actor_resources,
                                                 replica_resources)
from serve_app.common.engine_resources import (ACCELERATOR_RESOURCE, RAY_NODE_MEMORY,
                                              engine_need)
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment, mesh_parts


#: A Kubernetes quantity: a number and an optional SI (k, M, ...) or binary (Ki, Mi, ...) unit.
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


@dataclass
class WorkerGroup:
    """One KubeRay worker group: the engine replicas of one resource shape, one pod each.

    ``cpus``, ``gpus``: whole units per pod; ``memory``: bytes per pod; ``resources``: Ray
    custom resources each pod advertises; ``accelerator_type``: the GPU type its variants
    need (Ray's name, ``H100``); the counts are pods (= engine replicas); ``sizing``: how each
    variant's pod figures were found, one line each (the manifest's comment, and warnings).
    """

    name: str
    cpus: int
    gpus: int
    memory: int
    resources: dict[str, float]
    replicas: int
    min_replicas: int
    max_replicas: int
    variants: list[str]
    accelerator_type: str | None = None
    sizing: list[str] = field(default_factory=list)
    unsized: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PodSize:
    """What one replica's pod needs: the Ray resources Serve asks for (its actor, or the sum
    of its placement group's bundles, as ``PACK`` puts the group on one pod), raised to what
    its engine runs (:func:`~serve_app.common.engine_resources.engine_need`)."""

    cpus: int
    gpus: int
    memory: int  # bytes; 0: not known (the pod gets --worker-memory)
    resources: dict[str, float]
    accelerator_type: str | None
    how: str


def pod_size(args: VariantArgs, dep: dict[str, Any]) -> PodSize:
    """The pod one replica of a variant needs (``args``: its valid ``VariantArgs``;
    ``dep``: its ``LLMReplica`` deployment entry, whose options ``meshctl validate``
    accepted)."""
    # As Serve: the config's options replace the code's whole.
    placed = replica_resources(args, dep)
    opts = placed.get("ray_actor_options") or {}
    accelerator = args.accelerator_type or opts.get("accelerator_type")
    if bundles := placed.get("placement_group_bundles"):  # the whole group on one pod
        asks: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                asks[k] = asks.get(k, 0) + v
    else:
        asks = actor_resources(opts)  # num_cpus: Serve's default 1 when absent
    gpus = math.ceil(asks.pop("GPU", 0))
    cpus = max(1, math.ceil(asks.pop("CPU", 0)))
    memory = math.ceil(asks.pop("memory", 0))
    resources = {k: v for k, v in asks.items()
                 if not k.startswith(ACCELERATOR_RESOURCE.format(""))}
    how = "Ray resources of its " + ("placement group" if bundles else "actor")
    if gpus and args.engine == "vllm":
        need = engine_need(args, max(1, args.gpus_per_replica))
        if need.cpus > cpus or need.memory > memory:
            how = (f"its engine on {need.gpus} GPU(s) needs {need.cpus} CPUs and "
                   + (f"{format_quantity(need.memory)}, the weights {need.weights} bytes from "
                      f"{need.how}" if need.memory else f"memory not known ({need.how})"))
        cpus, memory = max(cpus, need.cpus), max(memory, need.memory)
        if memory:  # Ray's own processes on the pod, which no Ray resource counts
            memory += RAY_NODE_MEMORY
            how += f"; + {format_quantity(RAY_NODE_MEMORY)} for Ray's own processes"
    return PodSize(cpus=cpus, gpus=gpus, memory=memory, resources=resources,
                   accelerator_type=accelerator, how=how)


def worker_groups(serve_config: dict[str, Any], *, worker_memory: int,
                  spare_workers: int = 0) -> list[WorkerGroup]:
    """The worker groups of a valid Serve config (see :func:`rayservice_manifest`);
    ``worker_memory`` in bytes: a pod's memory when nothing sizes it."""
    groups: dict[tuple, WorkerGroup] = {}
    for app_name, app in mesh_parts(serve_config).variant_apps.items():
        dep = deployment(app, REPLICA_DEPLOYMENT) or {}
        size = pod_size(VariantArgs.model_validate(app.get("args") or {}), dep)
        low, initial, high = _replica_counts(dep, REPLICA_OPTIONS["num_replicas"])
        key = (size.gpus, size.accelerator_type, tuple(sorted(size.resources)))
        g = groups.get(key)
        if g is None:
            g = groups[key] = WorkerGroup(name="", cpus=0, gpus=size.gpus, memory=0,
                                          resources={}, replicas=0, min_replicas=0,
                                          max_replicas=spare_workers, variants=[],
                                          accelerator_type=size.accelerator_type)
        g.cpus = max(g.cpus, size.cpus)
        g.memory = max(g.memory, size.memory or worker_memory)
        if not size.memory:
            g.unsized.append(app_name)
        g.sizing.append(f"{app_name}: {size.cpus} CPUs, "
                        f"{format_quantity(size.memory or worker_memory)}"
                        + (f", {size.gpus} GPU(s)" if size.gpus else "")
                        + f" ({size.how if size.memory else 'memory: --worker-memory'})")
        for k, v in size.resources.items():
            g.resources[k] = max(g.resources.get(k, 0), v)
        g.replicas += initial
        g.min_replicas += low
        g.max_replicas += high
        g.variants.append(app_name)
    names: set[str] = set()
    for (gpus, accelerator, keys), g in groups.items():
        g.name = _unique(_group_name(gpus, accelerator, keys), names)
    return list(groups.values())


def autoscales(dep: dict[str, Any]) -> bool:
    """Whether a deployment entry autoscales (``autoscaling_config``, or ``num_replicas: auto``)."""
    return dep.get("autoscaling_config") is not None or dep.get("num_replicas") == "auto"


def _replica_counts(dep: dict[str, Any], code_default: int) -> tuple[int, int, int]:
    """(minimum, initial, maximum) replicas of a deployment entry, as Serve resolves them."""
    if not autoscales(dep):
        n = dep.get("num_replicas")
        n = code_default if n is None else n
        return n, n, n
    from ray.serve.config import AutoscalingConfig

    # num_replicas: auto starts from Serve's default autoscaling config (max 100); a plain
    # autoscaling_config from the field defaults (handle_num_replicas_auto in Serve).
    given = dict(dep.get("autoscaling_config") or {})
    if dep.get("num_replicas") == "auto":
        given = {**AutoscalingConfig.default().model_dump(exclude_unset=True), **given}
    asc = AutoscalingConfig.model_validate(given)
    initial = asc.min_replicas if asc.initial_replicas is None else asc.initial_replicas
    return asc.min_replicas, initial, asc.max_replicas


def _group_name(gpus: int, accelerator: str | None, resource_keys: tuple[str, ...]) -> str:
    parts = ["engines", f"gpu{gpus}" if gpus else "cpu", *([accelerator] if accelerator else []),
             *resource_keys]
    name = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
    return name[:40].rstrip("-")


def _unique(name: str, taken: set[str]) -> str:
    candidate, i = name, 2
    while candidate in taken:
        candidate, i = f"{name}-{i}", i + 1
    taken.add(candidate)
    return candidate


def parse_quantity(value: str | int) -> int:
    """Bytes in a Kubernetes memory quantity (``8Gi``, ``512Mi``, ``1G``, ``1073741824``).

    Raises:
        ValueError: not such a quantity, or not positive.
    """
    m = _QUANTITY.match(str(value).strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"got {value!r}; need a positive Kubernetes quantity such as 8Gi, "
                         "512Mi or a number of bytes")
    return math.ceil(float(m.group(1)) * _UNITS[m.group(2)])


def format_quantity(n_bytes: int) -> str:
    """A byte count as the shortest exact Kubernetes quantity (``8Gi``, ``1536Mi``, bytes)."""
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        if n_bytes % _UNITS[unit] == 0:
            return f"{n_bytes // _UNITS[unit]}{unit}"
    return str(n_bytes)


def whole(resources: dict[str, float]) -> dict[str, float]:
    """Ray resources with whole numbers written as ints (``1``, not ``1.0``)."""
    return {k: int(v) if float(v).is_integer() else v for k, v in resources.items()}
