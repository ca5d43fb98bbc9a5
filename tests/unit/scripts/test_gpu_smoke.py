"""scripts/gpu_smoke.sh and scripts/check_driver.sh as far as a CPU host can take them.

check_driver.sh runs against a fake ``nvidia-smi`` (tests/support/gpu_host.py): a driver older
than the GPU lock's CUDA needs is refused in one line naming both fixes, a new enough one (or
CUDA's forward-compatibility driver on LD_LIBRARY_PATH) passes, no driver is a clear message,
and the CUDA needed is read from the lock's pins.

gpu_smoke.sh's --dry-run starts the local hub, fetches the embedded model from it over the hub
protocol, and writes the configs (two bf16 GPU variants with CUDA graphs at 90/10 with one
adapter, pinned to the hub's commit; the adapter swapped; a tensor_parallel_size 2 variant),
which pass meshctl validate and are an in-place change for meshctl diff. Every exit past the
arguments writes the JSON: a step failed on purpose (SMOKE_FAIL_AT), a spent budget, a driver
refused before set-up. Its non-dry start runs in a copy of the repository whose set-up only
sleeps: the budget starts after set-up. The GPU run itself needs a GPU host
(docs/gpu-fleet.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app.common.paths import REPO_ROOT
from tests.support.gpu_host import (NVIDIA_SMI_FAILED, environment, fake_nvidia_smi,
                                    repo_copy, tool_path)

SCRIPT = REPO_ROOT / "scripts" / "gpu_smoke.sh"
CHECK = REPO_ROOT / "scripts" / "check_driver.sh"
GPU_LOCK = REPO_ROOT / "requirements-gpu.txt"
SHELL_SCRIPTS = ["gpu_smoke.sh", "check_driver.sh", "install_lock.sh", "setup.sh"]


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_shellcheck_clean(name):
    shellcheck = Path(sys.executable).parent / "shellcheck"
    r = subprocess.run([str(shellcheck), "-x", f"scripts/{name}"], capture_output=True,
                       text=True, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_help_prints_the_header_and_runs_nothing(name, tmp_path):
    r = subprocess.run([str(REPO_ROOT / "scripts" / name), "--help"], capture_output=True,
                       text=True, timeout=30, cwd=tmp_path)
    assert r.returncode == 0 and len(r.stdout.splitlines()) >= 10, r.stderr
    assert "Environment [default]" in r.stdout and list(tmp_path.iterdir()) == []


# -- check_driver.sh ---------------------------------------------------------------------------

def lock_pin(name: str) -> str:
    """``name==version`` as the GPU lock pins it."""
    m = re.search(rf"^({re.escape(name)}==\S+) \\$", GPU_LOCK.read_text(), re.M)
    assert m, f"requirements-gpu.txt pins no {name}"
    return m[1]


def check(tmp_path, driver: str | None = None, *args: str, nvidia_smi: bool = True,
          **env: str) -> subprocess.CompletedProcess:
    """check_driver.sh on a host whose nvidia-smi reports ``driver`` (None: fails as with no
    driver loaded); ``nvidia_smi=False``: no nvidia-smi at all."""
    bin_dir = tmp_path / "bin"
    if nvidia_smi:
        fake_nvidia_smi(bin_dir, driver)
    env.setdefault("NVIDIA_VERSION_FILE", str(tmp_path / "no-proc-version"))
    return subprocess.run([str(CHECK), *args], capture_output=True, text=True, timeout=60,
                          env=environment(tool_path(bin_dir), **env))


@pytest.mark.parametrize("driver", ["535.104.05", "550.163.01", "570.172.08", "580.00.01"])
def test_a_driver_older_than_r580_is_refused_naming_both_fixes(tmp_path, driver):
    r = check(tmp_path, driver)
    assert r.returncode == 1 and r.stdout == ""
    line, = r.stderr.splitlines()
    toolkit = lock_pin("cuda-toolkit")
    assert line.startswith(f"check_driver.sh: NVIDIA driver {driver} is older than 580.65.06, "
                           f"which CUDA 13.0 needs ({toolkit} in requirements-gpu.txt)"), line
    assert "install driver R580 or newer" in line  # fix 1
    # fix 2, with its exact steps
    assert "on a data-center GPU CUDA's forward-compatibility package" in line
    assert "apt-get install cuda-compat-13-0" in line
    assert "export LD_LIBRARY_PATH=/usr/local/cuda-13.0/compat:$LD_LIBRARY_PATH" in line
    assert "MESH_SKIP_DRIVER_CHECK=1" in line


def test_the_guide_shows_the_refusal_as_it_is(tmp_path):
    """docs/gpu-fleet.md's driver section quotes the refusal of a 535 driver word for word."""
    doc = (REPO_ROOT / "docs" / "gpu-fleet.md").read_text()
    quoted, = re.findall(r"^check_driver\.sh: NVIDIA driver 535\.104\.05 .*$", doc, re.M)
    assert check(tmp_path, "535.104.05").stderr.strip() == quoted


@pytest.mark.parametrize("driver", ["580.65.06", "580.95.05", "590.44.01", "1000.1"])
def test_an_r580_or_newer_driver_passes(tmp_path, driver):
    r = check(tmp_path, driver)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"[driver] NVIDIA driver {driver}: CUDA 13.0 "
                                f"({lock_pin('cuda-toolkit')}, requirements-gpu.txt) needs "
                                "580.65.06 or newer: ok")


def test_no_driver_at_all_is_one_clear_line(tmp_path):
    r = check(tmp_path, nvidia_smi=False)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"check_driver.sh: no NVIDIA driver found (no nvidia-smi on PATH, no "
        f"{tmp_path / 'no-proc-version'}): not a GPU host, or the driver is not loaded; "
        f"requirements-gpu.txt needs driver 580.65.06 or newer (CUDA 13.0, "
        f"{lock_pin('cuda-toolkit')}); on a CPU host use the default MESH_ACCEL=cpu"]


def test_a_failing_nvidia_smi_says_what_it_said(tmp_path):
    r = check(tmp_path, None)
    assert r.returncode == 2
    assert f"(nvidia-smi failed: {NVIDIA_SMI_FAILED}, no " in r.stderr


@pytest.mark.parametrize("driver, rc", [("580.95.05", 0), ("535.247.01", 1)])
def test_without_nvidia_smi_the_kernel_module_version_is_read(tmp_path, driver, rc):
    proc = tmp_path / "version"
    proc.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  "
                    "Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 2025\n"
                    "GCC version:  gcc version 13.3.0\n")
    r = check(tmp_path, nvidia_smi=False, NVIDIA_VERSION_FILE=str(proc))
    assert r.returncode == rc, r.stderr
    assert f"NVIDIA driver {driver}" in r.stdout + r.stderr


@pytest.mark.parametrize("compat, rc", [("580.95.05", 0), ("575.57.08", 1)])
def test_the_forward_compatibility_driver_on_ld_library_path_counts(tmp_path, compat, rc):
    lib = tmp_path / "cuda-13.0" / "compat"
    lib.mkdir(parents=True)
    (lib / f"libcuda.so.{compat}").touch()
    (lib / "libcuda.so.1").touch()
    r = check(tmp_path, "535.104.05", LD_LIBRARY_PATH=f"/nowhere::{lib}")
    assert r.returncode == rc, r.stdout + r.stderr
    if rc == 0:
        assert (f"with CUDA's forward-compatibility driver {compat} ({lib}/libcuda.so.{compat} "
                "on LD_LIBRARY_PATH)") in r.stdout


def test_the_check_can_be_skipped(tmp_path):
    r = check(tmp_path, "535.104.05", MESH_SKIP_DRIVER_CHECK="1")
    assert r.returncode == 0
    assert r.stdout.startswith("[driver] not checked (MESH_SKIP_DRIVER_CHECK=1): "
                               "requirements-gpu.txt needs CUDA 13.0")


@pytest.mark.parametrize("pins, driver, rc, needs", [
    (["cuda-toolkit==12.8.1"], "535.104.05", 0, "CUDA 12.8 (cuda-toolkit==12.8.1"),
    (["cuda-toolkit==12.8.1"], "470.256.02", 1, "525.60.13, which CUDA 12.8 needs"),
    (["nvidia-cuda-runtime-cu12==12.4.127"], "470.256.02", 1, "cuda-compat-12-4"),
    (["nvidia-cublas-cu12==12.4.5.8", "nvidia-nccl-cu12==2.21.5"], "470.256.02", 1,
     "CUDA 12.0 needs (nvidia-cublas-cu12==12.4.5.8"),
    (["numpy==2.4.1"], "470.256.02", 0, "pins no CUDA packages"),
])
def test_the_cuda_needed_is_read_from_the_lock(tmp_path, pins, driver, rc, needs):
    lock = tmp_path / "requirements-x.txt"
    lock.write_text("".join(f"{p} \\\n    --hash=sha256:{'0' * 64}\n" for p in pins))
    r = check(tmp_path, driver, str(lock))
    assert r.returncode == rc, r.stdout + r.stderr
    assert needs in r.stdout + r.stderr


def test_a_cuda_major_without_a_known_driver_is_refused(tmp_path):
    lock = tmp_path / "requirements-x.txt"
    lock.write_text(f"cuda-toolkit==14.0.1 \\\n    --hash=sha256:{'0' * 64}\n")
    r = check(tmp_path, "600.1.2", str(lock))
    assert r.returncode == 2
    assert "no known driver minimum for CUDA 14" in r.stderr


# -- gpu_smoke.sh's Python, the GPU steps' included --------------------------------------------

def smoke_python() -> list[str]:
    """Every Python program gpu_smoke.sh runs: its heredocs and its ``python -c`` strings."""
    text = SCRIPT.read_text()
    return (re.findall(r"<<'EOF'[^\n]*\n(.*?)\nEOF\n", text, re.S)
            + re.findall(r"(?:python|\"\$PY\") -c '([^']*)'", text))


def test_the_gpu_steps_python_compiles_and_imports_what_exists():
    """The steps a dry run never reaches (canary, swap, bench, tp) run only on a GPU: their
    Python must at least compile, and what it imports from the mesh must be there."""
    import ast
    import importlib
    import importlib.util

    programs = smoke_python()
    assert len(programs) >= 10
    for program in programs:
        tree = ast.parse(compile(program, "gpu_smoke.sh", "exec", ast.PyCF_ONLY_AST))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert importlib.util.find_spec(alias.name), alias.name
            elif isinstance(node, ast.ImportFrom):
                if node.module.split(".")[0] in ("serve_app", "tests"):
                    module = importlib.import_module(node.module)
                    missing = [a.name for a in node.names if not hasattr(module, a.name)]
                    assert not missing, f"{node.module} has no {missing}"
                else:
                    assert importlib.util.find_spec(node.module), node.module


# -- gpu_smoke.sh --dry-run ----------------------------------------------------------------------

def smoke(*args, cwd=REPO_ROOT, timeout=420, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=environment(os.environ["PATH"], **env))


def figures(path: Path) -> dict:
    return json.loads(path.read_text())


def test_dry_run_fetches_from_the_hub_and_writes_valid_configs_and_the_json(tmp_path):
    # OUT relative to the caller's directory, not to the repository the script cds into.
    r = smoke("--dry-run", "out/smoke.json", cwd=tmp_path,
              SMOKE_WORKDIR=str(tmp_path / "work"))
    out = tmp_path / "out" / "smoke.json"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not (REPO_ROOT / "out").exists()
    got = figures(out)
    assert (got["status"], got["dry_run"], got["reason"]) == ("dry-run", True, None)
    assert [s["step"] for s in got["steps"]] == ["hub", "configs", "validate"]
    assert got["within_budget"] and got["seconds"] <= got["budget_s"] == 480

    hub = got["hub"]  # the model came over the hub protocol: each file fetched once
    assert re.fullmatch(r"[0-9a-f]{40}", hub["commit"])
    assert hub["url"].startswith("http://127.0.0.1:")
    assert hub["file_gets"][f"{hub['repo']}/model.safetensors"] == 1
    assert len(hub["file_gets"]) == hub["files"]

    cfg = {name: yaml.safe_load(Path(p).read_text()) for name, p in got["configs"].items()}
    assert sorted(cfg) == ["serve-tp", "serve-v0", "serve-v1", "serve-v2"]
    routes = cfg["serve-v1"]["applications"][0]["deployments"][0]["user_config"]["routes"]
    assert [(v["application"], v["weight"]) for v in routes["smollm"]["variants"]] == [
        ("smollm-v1", 90), ("smollm-v2", 10)]
    assert [a["name"] for a in cfg["serve-v0"]["applications"]] == ["mesh", "smollm-v1"]
    for app in cfg["serve-v1"]["applications"][1:]:
        args = app["args"]
        assert (args["model"], args["revision"]) == (hub["repo"], hub["commit"])
        assert app["runtime_env"]["env_vars"]["HF_ENDPOINT"] == hub["url"]
        assert args["engine_args"]["dtype"] == "bfloat16"
        assert args["engine_args"]["enforce_eager"] is False  # CUDA graphs
        assert app["deployments"][0]["ray_actor_options"]["num_gpus"] == 0.4
        assert app["deployments"][0]["user_config"]["adapters"] == [
            {"name": "acme-support", "version": 1}]
    assert [a["deployments"][0]["user_config"]["adapters"]
            for a in cfg["serve-v2"]["applications"][1:]] == [
        [{"name": "acme-support", "version": 2}]] * 2

    mesh, tp = cfg["serve-tp"]["applications"]
    assert mesh["deployments"][0]["user_config"]["routes"] == {
        "tiny": {"variants": [{"application": "tiny-tp2", "weight": 100}]}}
    assert tp["args"]["engine_args"]["tensor_parallel_size"] == 2
    assert "ray_actor_options" not in tp["deployments"][0]  # the GPUs are the bundles'
    tiny = json.loads((Path(tp["args"]["model"]) / "config.json").read_text())
    assert tiny["num_attention_heads"] % 2 == 0 and tiny["num_key_value_heads"] % 2 == 0

    assert all(f"{p}: ok" in r.stdout for p in got["configs"].values())
    assert "IN PLACE" in r.stdout and "RESTART" not in r.stdout
    assert "smollm-v2: ADDED" in r.stdout  # the canary joins; smollm-v1 is not touched


def test_a_failed_step_writes_the_json_with_what_it_gathered(tmp_path):
    out = tmp_path / "smoke.json"
    r = smoke("--dry-run", str(out), SMOKE_WORKDIR=str(tmp_path / "work"),
              SMOKE_FAIL_AT="configs")
    assert r.returncode == 1
    got = figures(out)
    assert (got["status"], got["step"]) == ("failed", "configs")
    assert got["reason"] == "step 'configs' failed on purpose (SMOKE_FAIL_AT=configs)"
    assert got["hub"]["commit"] and got["configs"] == {}  # the hub ran; no config was written
    assert f"gpu_smoke.sh: {got['reason']}" in r.stderr


@pytest.mark.parametrize("budget, reason", [
    ("0", r"over the 0 s budget before step 'hub'"),
    # the wait for the hub (or, on a fast host, the fetch) is stopped when the budget ends
    ("1", r"step '(hub|configs)' ran past the 1 s budget: \S+ stopped after 1 s"),
])
def test_every_wait_is_bounded_by_the_budget(tmp_path, budget, reason):
    r = smoke("--dry-run", SMOKE_BUDGET_S=budget, TMPDIR=str(tmp_path))
    assert r.returncode == 1
    got = figures(tmp_path / "gpu-smoke.json")  # OUT's default: $TMPDIR/gpu-smoke.json
    assert got["status"] == "failed"
    assert re.fullmatch(reason, got["reason"]), got["reason"]


@pytest.mark.parametrize("argv, env, line", [
    (["--bogus"], {}, "gpu_smoke.sh: unknown option '--bogus' (see ./scripts/gpu_smoke.sh "
                      "--help)"),
    (["a.json", "b.json"], {}, "gpu_smoke.sh: one OUT at most, not 'a.json b.json' (see "
                               "./scripts/gpu_smoke.sh --help)"),
    (["--dry-run"], {"SMOKE_EAGER": "yes"}, "gpu_smoke.sh: SMOKE_EAGER must be 0 or 1, not "
                                            "'yes' (see ./scripts/gpu_smoke.sh --help)"),
    (["--dry-run"], {"SMOKE_BUDGET_S": "8m"}, "gpu_smoke.sh: SMOKE_BUDGET_S must be a whole "
                                              "number of seconds, not '8m' (see "
                                              "./scripts/gpu_smoke.sh --help)"),
])
def test_bad_arguments_are_refused_in_one_line(argv, env, line):
    r = smoke(*argv, **env)
    assert r.returncode == 2
    assert r.stderr.strip() == line


# -- gpu_smoke.sh on a (fake) GPU host: the driver and the set-up ---------------------------------

@pytest.fixture
def gpu_host(tmp_path):
    """A repository copy whose set-up sleeps 3 s and installs nothing, and a PATH whose
    nvidia-smi is fake (write it with fake_nvidia_smi(host.bin, ...))."""
    class Host:
        repo = repo_copy(tmp_path / "repo", ("gpu_smoke.sh", "check_driver.sh"), setup_sleep_s=3)
        bin = tmp_path / "bin"
        out = tmp_path / "smoke.json"

        def run(self, **env):
            return subprocess.run(
                [str(self.repo / "scripts" / "gpu_smoke.sh"), str(self.out)], capture_output=True,
                text=True, timeout=300, env=environment(tool_path(self.bin), **env,
                                                        SMOKE_WORKDIR=str(tmp_path / "work")))
    return Host()


def test_an_old_driver_is_refused_before_set_up_and_the_json_says_why(gpu_host):
    fake_nvidia_smi(gpu_host.bin, "550.163.01")
    r = gpu_host.run()
    assert r.returncode == 1
    got = figures(gpu_host.out)
    assert (got["status"], got["step"], got["setup_s"]) == ("failed", "driver", None)
    assert got["reason"].startswith("check_driver.sh: NVIDIA driver 550.163.01 is older than "
                                    "580.65.06")
    assert got["reason"] in r.stderr.splitlines()
    assert not (gpu_host.repo / "setup-ran").exists()  # nothing installed


def test_no_driver_is_refused_before_set_up_pointing_at_the_dry_run(gpu_host):
    r = gpu_host.run(NVIDIA_VERSION_FILE="/nonexistent")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == ("gpu_smoke.sh: ./scripts/gpu_smoke.sh --dry-run checks "
                                         "what a host without a GPU can")
    got = figures(gpu_host.out)
    assert got["step"] == "driver" and got["reason"].startswith(
        "check_driver.sh: no NVIDIA driver found (no nvidia-smi on PATH")
    assert not (gpu_host.repo / "setup-ran").exists()


def test_the_budget_starts_after_set_up(gpu_host):
    """Set-up takes 3 s against a 2 s budget; the first step after it still runs (and fails
    there on purpose, as no GPU is here to go on with)."""
    fake_nvidia_smi(gpu_host.bin, "580.95.05", gpus=2)
    r = gpu_host.run(SMOKE_BUDGET_S="2", SMOKE_FAIL_AT="hub")
    assert r.returncode == 1, r.stderr
    assert (gpu_host.repo / "setup-ran").read_text().strip() == "gpu"
    got = figures(gpu_host.out)
    assert got["reason"] == "step 'hub' failed on purpose (SMOKE_FAIL_AT=hub)"
    assert got["setup_s"] >= 3 and got["seconds"] < 2
    assert [(s["step"], s["at_s"]) for s in got["steps"]][-1] == ("hub", 0)
    assert got["driver"].startswith("[driver] NVIDIA driver 580.95.05: CUDA 13.0")
    assert got["gpus"] == ["NVIDIA H100 80GB HBM3, 580.95.05, 81559 MiB"] * 2

