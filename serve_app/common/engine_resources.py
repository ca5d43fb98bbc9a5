"""What one replica of a GPU variant runs beside its GPUs, in CPUs and host memory: the
figures its Ray resources and its KubeRay pod are sized from.

The processes of one replica (vLLM 0.32 with Ray Serve):

- the **replica actor** (Serve's, with vLLM's OpenAI front end, tokenizer and detokenizer):
  :data:`ACTOR_CPUS`, :data:`ACTOR_MEMORY`;
- vLLM's **engine core** process, the actor's child: on one GPU it is also the GPU worker;
  for an engine that spans GPUs it schedules, and vLLM's Ray executor starts one
  **GPU worker** per GPU, each an actor in the replica's placement group:
  :data:`ENGINE_CORE_CPUS`, :data:`ENGINE_CORE_MEMORY`;
- per **GPU worker**: :data:`GPU_WORKER_CPUS`, :data:`GPU_WORKER_MEMORY` (CUDA context,
  torch, NCCL buffers, pinned staging), plus its share of the **weights**, which it reads
  through host memory while it loads them (:func:`~serve_app.common.model_weights.weight_bytes`).

So a replica on one GPU needs 2 CPUs and 6 GiB + the weights, which its actor's options ask
for; one on N GPUs 2 + N CPUs and 4 GiB + N x 4 GiB + the weights, which its placement group
holds bundle by bundle: every bundle its GPU worker (``{GPU: 1, CPU: 1, memory: 4 GiB +
weights / N}``), the first one also the actor and its engine core (2 CPUs, 4 GiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30
#: CPUs and host memory (bytes) of the replica actor.
ACTOR_CPUS = 1
ACTOR_MEMORY = 2 * GiB
#: Of vLLM's engine-core process of an engine that spans GPUs (on one GPU, the core is the
#: GPU worker: :data:`GPU_WORKER_CPUS`, :data:`GPU_WORKER_MEMORY`).
ENGINE_CORE_CPUS = 1
ENGINE_CORE_MEMORY = 2 * GiB
#: Of each process that drives a GPU, its share of the weights aside.
GPU_WORKER_CPUS = 1
GPU_WORKER_MEMORY = 4 * GiB
#: Of Ray's own processes on a worker pod (raylet, its agents), which no Ray resource counts:
#: a pod sized for its replica has this much more.
RAY_NODE_MEMORY = 1 * GiB
#: The Ray resource an ``accelerator_type`` asks for, and how much of it each GPU bundle
#: takes (Ray Serve LLM's ``GPUAccelerator.default_bundles``): a node of that type has 1.
ACCELERATOR_RESOURCE = "accelerator_type:{}"
ACCELERATOR_SHARE = 0.001


@dataclass(frozen=True)
class EngineNeed:
    """What one replica's engine on ``gpus`` GPUs runs beside them.

    Attributes:
        gpus: GPUs its engine spans (``tensor_parallel_size`` x ``pipeline_parallel_size``,
            or 1).
        cpus: whole CPUs: the actor, the engine core, one per GPU worker.
        memory: host memory, bytes (a whole number of GiB, rounded up); 0 when the weights'
            size is not known here.
        weights: bytes of weights (0: not known), and ``how`` that figure was found.
    """

    gpus: int
    cpus: int
    memory: int
    weights: int
    how: str

    def actor_share(self) -> dict[str, float]:
        """What the replica actor's process tree holds besides the GPU workers, as bundle
        keys: on one GPU, everything (``CPU`` and ``memory``); for an engine that spans GPUs,
        the actor and its engine core (the first bundle of the placement group holds it)."""
        if self.gpus <= 1:
            share: dict[str, float] = {"CPU": self.cpus, "memory": self.memory}
        else:
            share = {"CPU": ACTOR_CPUS + ENGINE_CORE_CPUS,
                     "memory": (ACTOR_MEMORY + ENGINE_CORE_MEMORY) if self.memory else 0}
        return {k: v for k, v in share.items() if v}

    def worker_bundle(self, accelerator_type: str | None = None) -> dict[str, float]:
        """One GPU worker's placement-group bundle: ``{GPU: 1, CPU: 1, memory: ...}`` (and the
        accelerator's resource)."""
        bundle: dict[str, float] = {"GPU": 1, "CPU": GPU_WORKER_CPUS}
        if self.memory:
            bundle["memory"] = _whole_gib(GPU_WORKER_MEMORY + self.weights / self.gpus)
        if accelerator_type:
            bundle[ACCELERATOR_RESOURCE.format(accelerator_type)] = ACCELERATOR_SHARE
        return bundle


def engine_need(args, gpus: int, *, cached: bool = True) -> EngineNeed:
    """What a replica of ``args`` (a :class:`~serve_app.common.config.VariantArgs`) whose
    engine spans ``gpus`` GPUs (>= 1) needs beside them (see the module docstring).

    Args:
        cached: read the weights' size from this node's cache too
            (:func:`~serve_app.common.model_weights.weight_bytes`); False: only from a local
            folder or the name, the same on every node.
    """
    from serve_app.common.model_weights import weight_bytes

    weights = weight_bytes(args, cached=cached)
    if gpus <= 1:
        cpus = ACTOR_CPUS + GPU_WORKER_CPUS
        memory = ACTOR_MEMORY + GPU_WORKER_MEMORY + weights.bytes
    else:
        cpus = ACTOR_CPUS + ENGINE_CORE_CPUS + gpus * GPU_WORKER_CPUS
        memory = (ACTOR_MEMORY + ENGINE_CORE_MEMORY + gpus * GPU_WORKER_MEMORY
                  + weights.bytes)
    return EngineNeed(gpus=max(1, gpus), cpus=cpus,
                      memory=_whole_gib(memory) if weights.bytes else 0,
                      weights=weights.bytes, how=weights.how)


def _whole_gib(n_bytes: float) -> int:
    return math.ceil(n_bytes / GiB) * GiB
