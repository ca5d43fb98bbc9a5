"""What one replica of a GPU variant runs beside its GPUs
(:mod:`serve_app.common.engine_resources`): the actor, vLLM's engine core, one worker per
GPU, and the weights' bytes."""

from __future__ import annotations

import pytest

from serve_app.common.config import VariantArgs
from serve_app.common.engine_resources import (ACTOR_CPUS, ACTOR_MEMORY, ENGINE_CORE_CPUS,
                                               ENGINE_CORE_MEMORY, GPU_WORKER_CPUS,
                                               GPU_WORKER_MEMORY, GiB, engine_need)
from tests.support.model_configs import LLAMA_8B, LLAMA_8B_COMMIT, LLAMA_8B_WEIGHT_BYTES

LLAMA = VariantArgs.model_validate({"model": LLAMA_8B, "revision": LLAMA_8B_COMMIT,
                                    "served_model_name": "llama",
                                    "engine_args": {"dtype": "bfloat16"}})


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_cpus_and_memory_for_llama_8b(gpus):
    need = engine_need(LLAMA, gpus)
    processes = ACTOR_MEMORY + (GPU_WORKER_MEMORY if gpus == 1 else
                                ENGINE_CORE_MEMORY + gpus * GPU_WORKER_MEMORY)
    assert need.cpus == (ACTOR_CPUS + GPU_WORKER_CPUS if gpus == 1 else
                         ACTOR_CPUS + ENGINE_CORE_CPUS + gpus * GPU_WORKER_CPUS)
    assert need.cpus >= ACTOR_CPUS + gpus  # the actor, and a CPU for each GPU worker
    assert need.memory % GiB == 0 and need.memory >= LLAMA_8B_WEIGHT_BYTES + processes
    assert need.memory - (need.weights + processes) < GiB  # rounded up to a GiB, no more


def test_the_first_bundle_share_and_a_workers_bundle():
    need = engine_need(LLAMA, 2)
    assert need.actor_share() == {"CPU": ACTOR_CPUS + ENGINE_CORE_CPUS,
                                  "memory": ACTOR_MEMORY + ENGINE_CORE_MEMORY}
    bundle = need.worker_bundle("H100")
    assert bundle["GPU"] == 1 and bundle["CPU"] == GPU_WORKER_CPUS
    assert bundle["memory"] >= GPU_WORKER_MEMORY + need.weights / 2
    assert bundle["accelerator_type:H100"] == 0.001
    one = engine_need(LLAMA, 1)
    assert one.actor_share() == {"CPU": one.cpus, "memory": one.memory}  # the actor has all


def test_an_unknown_size_leaves_memory_unset():
    args = VariantArgs.model_validate({"model": "s3://models/mistral-nemo", "engine_args": {},
                                       "served_model_name": "m"})
    need = engine_need(args, 2)
    assert need.memory == 0 and need.cpus == 4 and "memory" not in need.worker_bundle()
