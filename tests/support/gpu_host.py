"""A GPU host as the set-up scripts see it, faked on a CPU host: an ``nvidia-smi`` on PATH that
prints a chosen driver version, a PATH that holds only the tools a script needs (so this
host's own ``nvidia-smi`` or ``python3.11`` cannot leak in), and a copy of the repository whose
``scripts/setup.sh`` only records that it ran (scripts/check_driver.sh, scripts/setup.sh and
scripts/gpu_smoke.sh are tested this way: tests/unit/scripts/test_gpu_smoke.py, test_lock.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from serve_app.common.paths import REPO_ROOT

#: What the scripts under test run besides themselves.
TOOLS = ("bash", "env", "cat", "cut", "dirname", "grep", "head", "tail", "tr", "sed", "sort",
         "awk", "mkdir", "mktemp", "realpath", "sha256sum", "sleep", "timeout", "touch", "wc",
         "kill", "date", "rm", "cp", "ls")
#: What a GPU failing its driver says (nvidia-smi's own words).
NVIDIA_SMI_FAILED = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                     "driver. Make sure that the latest NVIDIA driver is installed and running.")


def tool_path(bin_dir: Path, *extra: str) -> str:
    """A PATH of one folder, ``bin_dir``, holding links to :data:`TOOLS` and ``extra`` as this
    host has them (fakes written into ``bin_dir`` first stay)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in (*TOOLS, *extra):
        found = shutil.which(name)
        if found and not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(found)
    return str(bin_dir)


def fake_nvidia_smi(bin_dir: Path, driver: str | None, gpus: int = 1) -> Path:
    """Write ``bin_dir/nvidia-smi``: ``--query-gpu=driver_version`` prints ``driver`` once per
    GPU, ``--query-gpu=name,driver_version,memory.total`` an H100's line per GPU,
    ``--query-compute-apps`` nothing; ``driver=None``: fails as nvidia-smi does with no
    driver loaded (exit 9)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-smi"
    if driver is None:
        body = f'echo "{NVIDIA_SMI_FAILED}"\nexit 9\n'
    else:
        body = (f'for i in $(seq {gpus}); do\n'
                f'  case "$*" in\n'
                f'    *name,driver_version*) echo "NVIDIA H100 80GB HBM3, {driver}, 81559 MiB";;\n'
                f'    *driver_version*) echo "{driver}";;\n'
                f'    *compute-apps*) ;;\n'
                f'    *) echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 9;;\n'
                f'  esac\n'
                f'done\n')
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    if not (bin_dir / "seq").exists() and shutil.which("seq"):
        (bin_dir / "seq").symlink_to(shutil.which("seq"))
    return path


def repo_copy(root: Path, scripts: tuple[str, ...], setup_sleep_s: float = 0,
              links: tuple[str, ...] | None = None) -> Path:
    """A repository at ``root``: links to this one's top-level entries named in ``links``
    (None: all of them, the venv, the code and the models included), real copies of
    ``scripts`` (names under scripts/), and a ``scripts/setup.sh`` that sleeps
    ``setup_sleep_s``, writes its ``MESH_ACCEL`` into ``root/setup-ran`` and installs nothing
    (unless ``setup.sh`` is among ``scripts``)."""
    (root / "scripts").mkdir(parents=True)
    for entry in REPO_ROOT.iterdir():
        if entry.name not in ("scripts", ".git") and (links is None or entry.name in links):
            (root / entry.name).symlink_to(entry)
    for name in scripts:
        shutil.copy2(REPO_ROOT / "scripts" / name, root / "scripts" / name)
    if "setup.sh" not in scripts:
        fake = root / "scripts" / "setup.sh"
        fake.write_text(f'#!/usr/bin/env bash\nsleep {setup_sleep_s}\n'
                        f'echo "${{MESH_ACCEL:-}}" > "{root / "setup-ran"}"\n')
        fake.chmod(0o755)
    return root


def environment(path: str, **extra: str) -> dict[str, str]:
    """This process's environment with ``PATH`` replaced and no variable the scripts read
    (``MESH_*``, ``SMOKE_*``, ``PYTHON``, ``LD_LIBRARY_PATH``) unless given in ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MESH_SKIP", "MESH_ACCEL", "SMOKE_"))
           and k not in ("PYTHON", "LD_LIBRARY_PATH", "NVIDIA_VERSION_FILE")}
    return {**env, "PATH": path, **extra}
