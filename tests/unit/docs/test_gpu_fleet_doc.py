"""docs/gpu-fleet.md: its manifest entries parse as adapter sources, its TP example gets a
4-GPU pod, its pod-sizing figures are what ``meshctl kuberay`` writes, its fleet file is one
``--overlay`` takes, and what it says the GPU lock pins is what requirements-gpu.txt
pins."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from serve_app.common.adapters import AdapterSpec, adapter_source
from serve_app.common.paths import REPO_ROOT
from serve_app.release.kuberay import rayservice_manifest

DOC = REPO_ROOT / "docs" / "gpu-fleet.md"
BLOCKS = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)]
CONFIGS = [b for b in BLOCKS if isinstance(b, dict) and "applications" in b]
MANIFESTS = [b for b in BLOCKS if isinstance(b, dict) and "adapters" in b]
FLEET_FILES = [b for b in BLOCKS if isinstance(b, dict) and "accelerators" in b]


def test_the_guide_has_its_three_configs_a_manifest_and_a_fleet_file():
    """``meshctl validate`` runs on every config of the docs in test_doc_configs.py."""
    assert len(CONFIGS) == 3 and len(MANIFESTS) == 1 and len(FLEET_FILES) == 1


def pod(config: dict, overlay=None) -> dict:
    group, = rayservice_manifest(config, overlay=overlay)["spec"]["rayClusterConfig"][
        "workerGroupSpecs"]
    return group["template"]["spec"]


def limits(config: dict) -> dict:
    return pod(config)["containers"][0]["resources"]["limits"]


def test_the_pod_sizing_figures_are_kuberays():
    """The table of "Pod sizing" and the worked example's text."""
    text = DOC.read_text()
    tp4, own = (c for c in CONFIGS if "llama70b" in yaml.safe_dump(c))
    assert limits(tp4) == {"cpu": "6", "memory": "165Gi", "nvidia.com/gpu": "4"}
    assert "| 6 CPUs, 165Gi, 4 GPUs |" in text
    assert limits(own) == {"cpu": "8", "memory": "165Gi", "nvidia.com/gpu": "4"}
    assert "Its pod: 8 CPUs (the bundles'), and 165Gi" in text
    bundles = own["applications"][1]["deployments"][0]["placement_group_bundles"]
    assert sum(b["memory"] for b in bundles) == 156 * 2**30 and "bundles hold 156 GiB" in text
    one = copy.deepcopy(CONFIGS[0])  # the 8B variant, and the same as the TP 2 canary
    assert limits(one) == {"cpu": "4", "memory": "24Gi", "nvidia.com/gpu": "1"}
    assert "| 4 CPUs, 24Gi, 1 GPU |" in text
    variant = one["applications"][1]
    variant["args"]["engine_args"]["tensor_parallel_size"] = 2
    del variant["deployments"][0]["ray_actor_options"]
    assert limits(one) == {"cpu": "4", "memory": "31Gi", "nvidia.com/gpu": "2"}
    assert "| 4 CPUs, 31Gi, 2 GPUs |" in text


def test_the_fleet_file_is_one_overlay_takes():
    config = copy.deepcopy(CONFIGS[0])
    variant = config["applications"][1]
    variant["args"]["accelerator_type"] = "H100"
    variant["deployments"][0]["ray_actor_options"]["accelerator_type"] = "H100"
    spec = pod(config, overlay=FLEET_FILES[0])
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["serviceAccountName"] == "model-mesh"
    assert spec["volumes"][0]["hostPath"]["path"] == "/var/cache/model-mesh"


def test_the_tensor_parallel_example_gets_a_four_gpu_pod():
    tp = next(c for c in CONFIGS if "llama70b" in yaml.safe_dump(c))
    group, = rayservice_manifest(tp)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["groupName"] == "engines-gpu4"
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "4"


@pytest.mark.parametrize("entry", MANIFESTS[0]["adapters"] if MANIFESTS else [])
def test_the_manifest_entries_are_remote_sources(entry):
    assert adapter_source(AdapterSpec.model_validate(entry)).remote


def test_the_driver_paragraph_names_the_lock_pins():
    lock = (REPO_ROOT / "requirements-gpu.txt").read_text()
    text = DOC.read_text()
    for pin in ("vllm==0.32.0", "torch==2.13.0", "nvidia-cuda-runtime==13.0.96",
                "nvidia-cudnn-cu13==9.20.0.48", "nvidia-nccl-cu13==2.29.7"):
        assert f"\n{pin} " in lock and pin in text, pin
