"""Worker pods sized for what runs in them (:mod:`serve_app.release.kuberay_workers`): the
tried H100 config (tests/support/configs/first_day_fleet.yaml) and the guide's 70B example
get pods whose CPUs and memory hold the replica actor, vLLM's engine core, a worker per GPU
and the weights, with no hand edits."""

from __future__ import annotations

import re

import yaml

from serve_app.common.engine_resources import (ACTOR_CPUS, ACTOR_MEMORY, ENGINE_CORE_MEMORY,
                                               GPU_WORKER_MEMORY, GiB)
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.release.kuberay import rayservice_manifest
from serve_app.release.kuberay_workers import parse_quantity
from tests.support.model_configs import (LLAMA_8B, LLAMA_8B_COMMIT, LLAMA_8B_WEIGHT_BYTES,
                                         write_llama_8b)

FLEET = REPO_ROOT / "tests/support/configs/first_day_fleet.yaml"
#: Llama 3.3 70B's safetensors index total_size (70.6 billion bf16 parameters).
LLAMA_70B_WEIGHT_BYTES = 141_107_412_992


def pods(config: dict) -> dict[str, dict]:
    """groupName -> (cpus, memory bytes, gpus, replicas) of each worker group's pods."""
    out = {}
    for g in rayservice_manifest(config)["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        out[g["groupName"]] = {"cpus": int(limits["cpu"]),
                               "memory": parse_quantity(limits["memory"]),
                               "gpus": int(limits.get("nvidia.com/gpu", 0)),
                               "replicas": g["replicas"], "params": g["rayStartParams"]}
    return out


def enough(pod: dict, gpus: int, weights: int) -> None:
    """CPU >= the actor + 1 per GPU worker; memory >= weights + the processes' own."""
    processes = ACTOR_MEMORY + (GPU_WORKER_MEMORY if gpus == 1 else
                                ENGINE_CORE_MEMORY + gpus * GPU_WORKER_MEMORY)
    assert pod["gpus"] >= gpus
    assert pod["cpus"] >= ACTOR_CPUS + gpus
    assert pod["memory"] >= weights + processes


def test_the_tried_config_gets_pods_that_can_start():
    got = pods(load_yaml(FLEET))
    assert list(got) == ["engines-gpu1-h100", "engines-gpu2-h100"]
    one, two = got["engines-gpu1-h100"], got["engines-gpu2-h100"]
    enough(one, 1, LLAMA_8B_WEIGHT_BYTES)
    enough(two, 2, LLAMA_8B_WEIGHT_BYTES)
    assert (one["replicas"], two["replicas"]) == (2, 1)
    assert one["cpus"] == 4  # its own ray_actor_options' num_cpus: 4, more than it needs
    # Before: cpu '1', memory 8Gi for both. The figures, from the name (8B, bf16, + 10 %):
    assert (one["memory"], two["memory"]) == (24 * GiB, 31 * GiB)
    assert two["cpus"] == 4  # the actor, the engine core, two GPU workers
    # The autoscaler knows these pods are H100s.
    assert all('accelerator_type:H100' in p["params"]["resources"] for p in got.values())


def test_a_cached_copy_sizes_from_its_safetensors_index(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = tmp_path / "hf" / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct"
    write_llama_8b(repo / "snapshots" / LLAMA_8B_COMMIT, weights_index=True)
    (repo / "refs").mkdir()
    one = pods(load_yaml(FLEET))["engines-gpu1-h100"]
    enough(one, 1, LLAMA_8B_WEIGHT_BYTES)
    # 16.06 GB (14.96 GiB) of weights + 6 GiB, up to 21 GiB, + 1 GiB for Ray's processes
    assert one["memory"] == 22 * GiB


def test_the_guides_70b_tp4_example_gets_a_pod_for_it():
    text = (REPO_ROOT / "docs" / "gpu-fleet.md").read_text()
    config = next(c for c in (yaml.safe_load(b) for b in
                              re.findall(r"```yaml\n(.*?)```", text, re.S))
                  if isinstance(c, dict) and "llama70b" in yaml.safe_dump(c))
    [pod] = pods(config).values()
    enough(pod, 4, LLAMA_70B_WEIGHT_BYTES)
    assert (pod["cpus"], pod["gpus"]) == (6, 4)  # before: 1 CPU, 8Gi
