"""Where a replica runs (:mod:`serve_app.release.placement_check`); each refusal's exact
config and message is in tests/support/gpu_config_catalog.py. Here: the figures it borrows
from vLLM are vLLM's, and what it accepts."""

from __future__ import annotations

import copy

import pytest

from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.release.placement_check import VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
from serve_app.release.validate import validate_config

FLEET = REPO_ROOT / "tests/support/configs/first_day_fleet.yaml"
GiB = 2**30


def test_the_default_gpu_share_is_vllms():
    from vllm.config import CacheConfig

    field = CacheConfig.__pydantic_fields__["gpu_memory_utilization"]
    assert field.default == VLLM_DEFAULT_GPU_MEMORY_UTILIZATION


@pytest.mark.parametrize("deployment", [
    # the actor's memory, held by a first bundle written out (the guide's shape)
    {"ray_actor_options": {"num_cpus": 4, "memory": 8 * GiB},
     "placement_group_bundles": [
         {"GPU": 1, "CPU": 5, "memory": 45 * GiB, "accelerator_type:H100": 0.001},
         {"GPU": 1, "CPU": 1, "memory": 37 * GiB, "accelerator_type:H100": 0.001}],
     "placement_group_strategy": "STRICT_PACK"},
    # the actor within the mesh's own first bundle (3 CPUs, 17 GiB)
    {"ray_actor_options": {"num_cpus": 3, "memory": 16 * GiB}},
    # numbers Ray takes: floats, a share of 4 decimals
    {"ray_actor_options": {"num_cpus": 1.5}},
])
def test_what_a_tp_replica_may_write(deployment):
    cfg = copy.deepcopy(load_yaml(FLEET))
    cfg["applications"][2]["deployments"][0].update(deployment)
    assert validate_config(cfg) == []


def test_two_engines_may_share_a_gpu_within_their_shares():
    cfg = copy.deepcopy(load_yaml(FLEET))
    v1 = cfg["applications"][1]
    v1["args"]["engine_args"]["gpu_memory_utilization"] = 0.45
    v1["deployments"][0]["ray_actor_options"]["num_gpus"] = 0.5
    assert validate_config(cfg) == []
