"""Unit tests of the shipped CI release (deploy/ci/release.sh, deploy/ci/github-actions.yml),
without a mesh: every meshctl command the script runs parses with meshctl's real argument
parser, the steps run in order, a failing step's exit code is the script's, and the workflow
calls the script and keeps the report. tests/integration/test_rollouts.py runs the script against a
real mesh."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from serve_app import cli
from serve_app.common.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "deploy" / "ci" / "release.sh"
WORKFLOW = REPO_ROOT / "deploy" / "ci" / "github-actions.yml"


def release(tmp_path: Path, config: Path, *, fail: str = "", code: int = 0, **env):
    """Run release.sh with a stand-in meshctl that records its arguments (one call a line,
    NUL-separated) and exits ``code`` when its first argument is ``fail``."""
    calls = tmp_path / "calls"
    fake = tmp_path / "meshctl"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" >> {calls}\necho >> {calls}\n'
                    f'[ "$1" = "{fail}" ] && exit {code}\nexit 0\n')
    fake.chmod(0o755)
    proc = subprocess.run([str(SCRIPT), str(config)], capture_output=True, text=True,
                          env={**os.environ, "MESHCTL": str(fake), **env})
    argvs = [line.strip("\0").split("\0") for line in calls.read_text().splitlines()
             if line.strip("\0")] if calls.exists() else []
    return proc, argvs


class Parsed(Exception):
    pass


def parses(argv: list[str], monkeypatch) -> argparse.Namespace:
    """``argv`` parsed by meshctl's own parser (argparse exits 2 on an unknown flag)."""
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    with pytest.raises(Parsed) as got:
        cli.main(argv)
    monkeypatch.undo()
    return got.value.args[0]


def test_release_runs_the_four_steps_with_flags_meshctl_has(tmp_path, monkeypatch):
    config = REPO_ROOT / "serve_configs" / "rollout.yaml"
    proc, argvs = release(tmp_path, config, MESH_REPORT_DIR="out/r", MESH_SPLIT="smollm",
                          MESH_ROLLOUT_TIMEOUT_S="600", MESH_PROMETHEUS="")
    assert proc.returncode == 0, proc.stderr
    assert [a[:2] for a in argvs] == [["validate", str(config)], ["diff", "live"],
                                      ["deploy", str(config)], ["rollout", "status"]]
    ns = [parses(a, monkeypatch) for a in argvs]
    assert ns[0].against == "live" and not ns[0].allow_restart
    assert ns[3].watch and ns[3].timeout == 600 and ns[3].report == "out/r"
    assert ns[3].split == "smollm" and ns[3].prometheus == ""


def test_a_config_without_rollout_stops_after_the_deploy(tmp_path):
    proc, argvs = release(tmp_path, REPO_ROOT / "serve_configs" / "local.yaml")
    assert proc.returncode == 0 and [a[0] for a in argvs] == ["validate", "diff", "deploy"]


@pytest.mark.parametrize("step, code", [("validate", 1), ("deploy", 1), ("rollout", 2),
                                        ("rollout", 4)])
def test_the_failed_steps_exit_code_is_the_scripts(tmp_path, step, code):
    proc, argvs = release(tmp_path, REPO_ROOT / "serve_configs" / "rollout.yaml", fail=step,
                          code=code)
    assert proc.returncode == code
    assert argvs[-1][0] == step  # nothing after the failed step


def test_usage():
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 1 and "deploy/ci/release.sh CONFIG" in proc.stderr


def test_the_workflow_calls_the_script_and_keeps_the_report():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    job = workflow["jobs"]["release"]
    runs = [s.get("run", "") for s in job["steps"]]
    assert "./scripts/setup.sh" in runs and './deploy/ci/release.sh "$CONFIG"' in runs
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith(
        "actions/upload-artifact"))
    assert upload["if"] == "always()" and upload["with"]["path"].rstrip("/") == \
        job["env"]["MESH_REPORT_DIR"]
    assert int(job["env"]["MESH_ROLLOUT_TIMEOUT_S"]) < job["timeout-minutes"] * 60
