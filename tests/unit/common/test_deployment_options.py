"""Replicas that span GPUs: the deployment options and placement-group bundles built from
``tensor_parallel_size`` x ``pipeline_parallel_size`` (as Ray Serve LLM builds them), what
``meshctl validate`` refuses, what ``meshctl diff`` calls the change, and how ``meshctl
kuberay`` sizes the GPU workers. Offline: no GPU, no Ray cluster."""

from __future__ import annotations

import copy
import math

import pytest

from serve_app.common.config import VariantArgs
from serve_app.common.deployment_options import (REPLICA_OPTIONS, granted_gpus,
                                                 replica_options, replica_resources)
from serve_app.common.engine_resources import (ACTOR_CPUS, ACTOR_MEMORY, ENGINE_CORE_CPUS,
                                               ENGINE_CORE_MEMORY, GPU_WORKER_CPUS,
                                               GPU_WORKER_MEMORY, GiB)
from serve_app.common.model_weights import weight_bytes
from serve_app.common.serve_configs import load_yaml
from serve_app.common.paths import REPO_ROOT
from serve_app.release.config_diff import RESTART, diff_configs
from serve_app.release.kuberay import rayservice_manifest
from serve_app.release.validate import validate_config


def args(**engine) -> VariantArgs:
    return VariantArgs.model_validate({"served_model_name": "smollm", "engine_args": engine})


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_deployment_options_for_tp_1_2_4_8(tp):
    opts = replica_options(args(tensor_parallel_size=tp))
    if tp == 1:  # one GPU or CPUs: the options as before, no placement group
        assert opts == REPLICA_OPTIONS and "placement_group_strategy" not in opts
        assert granted_gpus(replica_resources(args(tensor_parallel_size=tp), {})) == 0
        return
    # Ray Serve LLM's shape: one bundle per GPU worker, the actor (1 CPU) in the first, PACK;
    # each bundle holds its worker's CPU and memory (its share of the 269 MB of weights), the
    # first also the actor and vLLM's engine core.
    weights = weight_bytes(args()).bytes
    worker = math.ceil((GPU_WORKER_MEMORY + weights / tp) / GiB) * GiB
    first = {"GPU": 1, "CPU": GPU_WORKER_CPUS + ACTOR_CPUS + ENGINE_CORE_CPUS,
             "memory": worker + ACTOR_MEMORY + ENGINE_CORE_MEMORY}
    assert opts["placement_group_bundles"] == (
        [first] + [{"GPU": 1, "CPU": GPU_WORKER_CPUS, "memory": worker}] * (tp - 1))
    assert opts["placement_group_strategy"] == "PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 1}
    assert {k: v for k, v in opts.items() if not k.startswith(("placement", "ray_actor"))
            } == {k: v for k, v in REPLICA_OPTIONS.items() if k != "ray_actor_options"}
    assert granted_gpus(replica_resources(args(tensor_parallel_size=tp), {})) == tp


def test_an_accelerator_type_makes_a_one_gpu_replica_and_pins_every_bundle():
    one = replica_options(args(dtype="bfloat16").model_copy(update={"accelerator_type": "L4"}))
    weights = weight_bytes(args()).bytes
    assert one["ray_actor_options"] == {
        "num_cpus": 2, "num_gpus": 1, "accelerator_type": "L4",
        "memory": math.ceil((ACTOR_MEMORY + GPU_WORKER_MEMORY + weights) / GiB) * GiB}
    two = replica_options(args(tensor_parallel_size=2).model_copy(
        update={"accelerator_type": "L4"}))
    assert [b["accelerator_type:L4"] for b in two["placement_group_bundles"]] == [0.001] * 2
    assert "accelerator_type" not in two["ray_actor_options"]  # its bundle holds it


def test_pipeline_parallel_counts_too():
    opts = replica_options(args(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert len(opts["placement_group_bundles"]) == 4


def test_the_options_are_a_valid_serve_replica_config():
    """Serve's own check: the actor must fit the first bundle of its placement group."""
    from ray.serve._private.config import ReplicaConfig

    for tp in (2, 4, 8):
        opts = replica_options(args(tensor_parallel_size=tp))
        ReplicaConfig.create(lambda: None, ray_actor_options=opts["ray_actor_options"],
                             placement_group_bundles=opts["placement_group_bundles"],
                             placement_group_strategy=opts["placement_group_strategy"])


def test_the_engine_gets_the_ray_executor_when_it_spans_gpus():
    from serve_app.server.engine import build_cli_namespace

    assert build_cli_namespace(args(tensor_parallel_size=1)).distributed_executor_backend \
        != "ray"
    with pytest.raises(ValueError, match="use 'ray'"):
        args(tensor_parallel_size=2, distributed_executor_backend="mp")


def gpu_config(tp: int, **deployment) -> dict:
    cfg = load_yaml(REPO_ROOT / "serve_configs" / "local.yaml")
    variant = cfg["applications"][1]
    variant["args"]["engine_args"].update(tensor_parallel_size=tp, dtype="bfloat16")
    variant["deployments"][0].update(deployment)
    return cfg


def test_validate_refuses_tp_over_the_gpus_granted():
    problems = validate_config(gpu_config(3, ray_actor_options={"num_cpus": 1, "num_gpus": 1}))
    assert len(problems) == 1 and "the replica is granted 2" in problems[0]
    assert validate_config(gpu_config(4)) == []  # the mesh's placement group: 4 GPUs
    assert validate_config(gpu_config(1, ray_actor_options={"num_cpus": 1, "num_gpus": 1})) \
        == []
    over = validate_config(gpu_config(2, ray_actor_options={"num_cpus": 4}))
    assert len(over) == 1 and over[0].startswith(
        "applications[1].deployments[LLMReplica].ray_actor_options.num_cpus: the replica "
        "actor asks for CPU 4, over the CPU 3 of the first bundle")


def test_diff_calls_a_tp_change_a_restart():
    old, new = gpu_config(1), gpu_config(4)
    changes = diff_configs(old, new)["smollm-v1"]
    tp = [c for c in changes if c.field == "args.engine_args.tensor_parallel_size"]
    assert len(tp) == 1 and tp[0].kind == RESTART and "placement group" in tp[0].reason


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kuberay_sizes_a_gpu_worker_per_replica(tp):
    deployment = {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}} if tp == 1 else {}
    cfg = gpu_config(tp, num_replicas=2, **deployment)
    groups = rayservice_manifest(cfg)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert len(groups) == 1
    g = groups[0]
    limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], g["rayStartParams"]["num-gpus"]) == (str(tp), str(tp))
    # the actor, vLLM's engine core (the GPU worker itself on one GPU), one per GPU worker
    cpus = ACTOR_CPUS + GPU_WORKER_CPUS if tp == 1 else \
        ACTOR_CPUS + ENGINE_CORE_CPUS + tp * GPU_WORKER_CPUS
    assert limits["cpu"] == str(cpus) and g["replicas"] == 2
    assert g["groupName"] == f"engines-gpu{tp}"


def test_tp_3_with_one_gpu_is_no_longer_a_one_gpu_pod():
    """The issue's case: it used to pass validate and get nvidia.com/gpu '1'."""
    cfg = gpu_config(3, ray_actor_options={"num_cpus": 1, "num_gpus": 1})
    with pytest.raises(ValueError, match="granted 2"):
        rayservice_manifest(copy.deepcopy(cfg))
