"""scripts/gpu_smoke.sh as far as a CPU host can take it: shellcheck-clean, and its --dry-run
writes the two smoke configs (two bf16 GPU variants at 90/10 with one adapter, then the
adapter swapped), which pass meshctl validate, are an in-place change for meshctl diff, and
leave the JSON skeleton. The GPU run itself needs a GPU host (docs/gpu-fleet.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from serve_app.common.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_smoke.sh"


def test_shellcheck_clean():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    r = subprocess.run([str(shellcheck), str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dry_run_writes_valid_configs_and_the_json(tmp_path):
    out = tmp_path / "smoke.json"
    r = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True,
                       env={**os.environ, "SMOKE_WORKDIR": str(tmp_path / "work")},
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["status"] == "dry-run" and figures["dry_run"] is True
    v1, v2 = (yaml.safe_load(Path(p).read_text()) for p in figures["configs"])
    routes = v1["applications"][0]["deployments"][0]["user_config"]["routes"]
    assert [(v["application"], v["weight"]) for v in routes["smollm"]["variants"]] == [
        ("smollm-v1", 90), ("smollm-v2", 10)]
    for app in v1["applications"][1:]:
        assert app["args"]["engine_args"]["dtype"] == "bfloat16"
        assert app["deployments"][0]["ray_actor_options"]["num_gpus"] == 0.4
        assert app["deployments"][0]["user_config"]["adapters"] == [
            {"name": "acme-support", "version": 1}]
    assert [a["deployments"][0]["user_config"]["adapters"] for a in v2["applications"][1:]] \
        == [[{"name": "acme-support", "version": 2}]] * 2
    assert "serve-v1.yaml: ok" in r.stdout and "serve-v2.yaml: ok" in r.stdout
    assert "IN PLACE" in r.stdout and "RESTART" not in r.stdout


def test_an_unknown_option_is_refused_in_one_line():
    r = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == ("gpu_smoke.sh: unknown option '--bogus' "
                                "(see ./scripts/gpu_smoke.sh --help)")
