"""Every Serve config in docs/gpu-fleet.md passes `meshctl validate`, its manifest entries
parse as adapter sources, and what it says the GPU lock pins is what requirements-gpu.txt
pins."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app.common.adapters import AdapterSpec, adapter_source
from serve_app.common.paths import REPO_ROOT
from serve_app.release.kuberay import rayservice_manifest

DOC = REPO_ROOT / "docs" / "gpu-fleet.md"
BLOCKS = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)]
CONFIGS = [b for b in BLOCKS if "applications" in b]
MANIFESTS = [b for b in BLOCKS if "adapters" in b]


def test_every_config_in_the_guide_passes_meshctl_validate(tmp_path):
    assert len(CONFIGS) == 2 and len(MANIFESTS) == 1
    paths = []
    for i, cfg in enumerate(CONFIGS):
        paths.append(tmp_path / f"config-{i}.yaml")
        paths[-1].write_text(yaml.safe_dump(cfg))
    meshctl = Path(sys.executable).parent / "meshctl"
    r = subprocess.run([str(meshctl), "validate", *map(str, paths)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": ok") == len(CONFIGS), r.stdout


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
