"""docs/gpu-fleet.md: its manifest entries parse as adapter sources, its TP example gets a
4-GPU pod, and what it says the GPU lock pins is what requirements-gpu.txt pins."""

from __future__ import annotations

import re

import pytest
import yaml

from serve_app.common.adapters import AdapterSpec, adapter_source
from serve_app.common.paths import REPO_ROOT
from serve_app.release.kuberay import rayservice_manifest

DOC = REPO_ROOT / "docs" / "gpu-fleet.md"
BLOCKS = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)]
CONFIGS = [b for b in BLOCKS if "applications" in b]
MANIFESTS = [b for b in BLOCKS if "adapters" in b]


def test_the_guide_has_its_two_configs_and_a_manifest():
    """``meshctl validate`` runs on every config of the docs in test_doc_configs.py."""
    assert len(CONFIGS) == 2 and len(MANIFESTS) == 1


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
