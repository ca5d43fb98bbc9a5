"""What people get when they give ``meshctl`` or a script something it cannot use: one line on
stderr that says what was wrong and how to fix it, exit status 2 (``rollout status``: 1, its
USAGE), never a traceback. Bad files, YAML typos, unreachable addresses, bad arguments.
Also ``--help`` on every script, with its defaults. No Ray cluster: an unreachable address is
``http://127.0.0.1:1``."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app import cli
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.tenancy.keys import hash_api_key
from serve_app.release.rollout_watch import USAGE

LOCAL = str(REPO_ROOT / "serve_configs" / "local.yaml")
TENANTS = str(REPO_ROOT / "serve_configs" / "tenants.yaml")
NOWHERE = "http://127.0.0.1:1"


@pytest.fixture
def files(tmp_path):
    """A YAML typo, a missing file, a config with a weight of -1, garbage metrics."""
    typo = tmp_path / "typo.yaml"
    typo.write_text(Path(LOCAL).read_text().replace("  - name: mesh\n", "  - name: mesh\n  x\n"))
    bad = copy.deepcopy(load_yaml(REPO_ROOT / "serve_configs" / "rollout.yaml"))
    bad["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]["variants"][
        0]["weight"] = -1
    weight = tmp_path / "weight.yaml"
    weight.write_text(yaml.safe_dump(bad))
    garbage = tmp_path / "metrics.txt"
    garbage.write_text("{{{\n")
    return {"typo": str(typo), "missing": str(tmp_path / "missing.yaml"),
            "weight": str(weight), "garbage": str(garbage), "tmp": tmp_path}


def meshctl(argv, capsys, stdin: str | None = None, monkeypatch=None) -> tuple[int, str]:
    """Exit status and stderr of ``meshctl argv`` run in this process."""
    if stdin is not None:
        import io
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


CASES = [  # (argv with {typo} {missing} {weight} {garbage}, exit status, what the line says)
    (["validate", "{missing}"], 2, "meshctl validate: cannot read {missing}: No such file"),
    (["validate", "{typo}"], 2, "meshctl validate: {typo}: not valid YAML: "),
    (["diff", LOCAL, "{typo}"], 2, "meshctl diff: {typo}: not valid YAML"),
    (["diff", "live", LOCAL, "-a", NOWHERE], 2,
     f"meshctl diff: cannot reach the Ray dashboard at {NOWHERE} (ConnectError"),
    (["validate", LOCAL, "--against", "live", "-a", NOWHERE, "--skip-engine-check"], 2,
     f"meshctl validate: cannot reach the Ray dashboard at {NOWHERE}"),
    (["deploy", LOCAL, "-a", NOWHERE], 2,
     f"meshctl deploy: cannot reach the Ray dashboard at {NOWHERE}"),
    (["deploy", "{typo}", "-a", NOWHERE], 2, "meshctl deploy: {typo}: not valid YAML"),
    (["wait", LOCAL, "-a", NOWHERE], 2,
     f"meshctl wait: cannot reach the Ray dashboard at {NOWHERE}"),
    (["wait", "{typo}"], 2, "meshctl wait: {typo}: not valid YAML"),
    (["wait", "{missing}"], 2, "meshctl wait: cannot read {missing}"),
    (["swap", "{missing}", "--route", "smollm", "--new-app", "x", "--model", "m"], 2,
     "meshctl swap: cannot read {missing}"),
    (["swap", LOCAL, "--route", "smollm", "--new-app", "x", "--steps", "50,40"], 2,
     "meshctl swap: argument --steps: --steps '50,40': need strictly increasing"),
    (["swap", LOCAL, "--route", "nope", "--new-app", "x", "--model", "m"], 2,
     "meshctl swap: route 'nope' is not in the router's user_config.routes (routes: smollm)"),
    (["swap", LOCAL, "--route", "smollm", "--new-app", "x"], 2,
     "meshctl swap: give the new variant's --model, or --engine-arg KEY=VALUE, or both"),
    (["swap", LOCAL, "--route", "smollm", "--new-app", "x", "--engine-arg", "max_num_seqs"],
     2, "meshctl swap: argument --engine-arg: 'max_num_seqs': give KEY=VALUE"),
    (["kuberay", "{typo}"], 2, "meshctl kuberay: {typo}: not valid YAML"),
    (["top-adapters", LOCAL, "--metrics", "{garbage}"], 2,
     "meshctl top-adapters: cannot read the router's metrics from {garbage} (not Prometheus "
     "metrics in text format"),
    (["top-adapters", LOCAL, "--metrics", NOWHERE + "/metrics"], 2,
     f"meshctl top-adapters: cannot read the router's metrics from {NOWHERE}/metrics"),
    (["top-adapters", "{typo}"], 2, "meshctl top-adapters: {typo}: not valid YAML"),
    (["rollout-report", "--router-url", NOWHERE], 2,
     f"meshctl rollout-report: cannot read {NOWHERE}/admin/rollouts (ConnectError"),
    (["hash-key", ""], 2, "meshctl hash-key: the key is empty"),
    (["hash-key", " sk-x"], 2, "meshctl hash-key: the key starts or ends with whitespace"),
    (["validate"], 2, "meshctl validate: the following arguments are required: configs"),
    (["validate", LOCAL, "--allow-restart"], 2,
     "meshctl validate: --allow-restart needs --against OLD"),
    (["deploy", LOCAL, "--timeout-s", "soon"], 2,
     "meshctl deploy: argument --timeout-s: invalid float value: 'soon'"),
    (["nosuch"], 2, "meshctl: argument command: invalid choice: 'nosuch'"),
    # rollout status: its own table, where 2 means "rolled back": usage errors are 1
    (["rollout", "status", "--config", "{typo}"], USAGE,
     "meshctl rollout status: --config {typo}: {typo}: not valid YAML"),
    (["rollout", "status", "--config", "{missing}"], USAGE,
     "meshctl rollout status: --config {missing}: cannot read it: No such file or directory"),
    (["rollout", "status", "--config", "{weight}"], USAGE,
     "meshctl rollout status: --config {weight}: the router's user_config is invalid: "
     "routes.smollm.variants.0.weight: Input should be greater than or equal to 0"),
    (["rollout", "status", "--bogus"], USAGE,
     "meshctl rollout status: unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv, code, line", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_meshctl_says_what_was_wrong_in_one_line(argv, code, line, files, capsys):
    argv = [a.format(**files) for a in argv]
    got, err = meshctl(argv, capsys)
    assert got == code, err
    assert one_line(err).startswith(line.format(**files)), err


def test_hash_key_refuses_an_empty_stdin(capsys, monkeypatch):
    got, err = meshctl(["hash-key"], capsys, stdin="\n", monkeypatch=monkeypatch)
    assert got == 2 and one_line(err).startswith("meshctl hash-key: the key is empty")
    assert meshctl(["hash-key"], capsys, stdin="sk-x\n", monkeypatch=monkeypatch)[0] == 0
    assert capsys.readouterr().out == ""  # read by meshctl() already
    cli.main(["hash-key", "sk-x"])
    assert capsys.readouterr().out.strip() == hash_api_key("sk-x")


def test_validate_a_missing_and_an_invalid_file_exits_2(files, tmp_path, capsys):
    """The worse outcome wins: a file that cannot be read (2) over an invalid one (1)."""
    got, err = meshctl(["validate", files["weight"], files["missing"], "--skip-engine-check"],
                       capsys)
    assert got == 2 and f"{files['weight']}: INVALID" in err and "Traceback" not in err


def test_swap_to_a_model_that_is_not_there_writes_nothing(files, capsys):
    out = files["tmp"] / "plan"
    got, err = meshctl(["swap", LOCAL, "--route", "smollm", "--new-app", "smollm-v2",
                        "--model", "nosuchmodel", "--emit", str(out)], capsys)
    assert got == 1 and not out.exists()
    assert "applications[2].args.model: model 'nosuchmodel' not found" in err


def test_swap_carries_new_engine_args_blue_green(files, capsys):
    out = files["tmp"] / "plan"
    got, err = meshctl(["swap", LOCAL, "--route", "smollm", "--new-app", "smollm-v2",
                        "--engine-arg", "max_num_seqs=16", "--engine-arg", "enforce_eager=null",
                        "--emit", str(out), "--skip-engine-check"], capsys)
    assert got == 0, err
    final = load_yaml(sorted(out.iterdir())[-1])
    [app] = [a for a in final["applications"] if a["name"] == "smollm-v2"]
    engine = app["args"]["engine_args"]
    assert engine["max_num_seqs"] == 16 and "enforce_eager" not in engine
    assert app["args"]["model"] == "smollm2-135m-instruct"  # kept


def test_top_adapters_says_why_nothing_merges(files, capsys):
    """Tokens for adapters that local.yaml does not serve: no claim that they are merged."""
    metrics = files["tmp"] / "m.txt"
    metrics.write_text('ray_mesh_prompt_tokens_total{route="smollm",adapter="acme-support"} 90\n')
    assert cli.main(["top-adapters", LOCAL, "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert "merged variants already" not in out
    assert ("smollm:acme-support: no variant of route 'smollm' declares it in this config"
            in out) and "is " + LOCAL + " the config deployed now?" in out


# -- scripts ----------------------------------------------------------------------------------

PY_SCRIPTS = sorted([*(REPO_ROOT / "scripts").glob("*.py"), REPO_ROOT / "dashboards" / "build.py"])
#: Shell scripts (their --help prints help and runs nothing).
SH_SCRIPTS = [REPO_ROOT / "scripts" / n for n in ("demo.sh", "setup.sh", "observability.sh",
                                                  "install_services.sh", "stop.sh",
                                                  "test.sh")] + [
    REPO_ROOT / "deploy" / "ci" / "release.sh"]


def run_script(*argv, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([*argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env={**os.environ, "COLUMNS": "100"})


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=[p.name for p in PY_SCRIPTS])
def test_every_python_script_has_help_with_its_defaults(script):
    res = run_script(sys.executable, str(script), "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: "), res.stderr
    assert "Traceback" not in res.stderr
    if re.search(r"--\w[\w-]* [A-Z_]+", res.stdout):  # options that take a value
        assert "(default: " in res.stdout, res.stdout


@pytest.mark.parametrize("script", SH_SCRIPTS, ids=[p.name for p in SH_SCRIPTS])
def test_every_shell_script_has_help(script):
    res = run_script(str(script), "--help")
    assert res.returncode == 0 and len(res.stdout.splitlines()) >= 3, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("argv, line", [
    (["bench.py", "--config", "nope.yaml"], "bench.py: --config nope.yaml: no such file"),
    (["bench.py", "--concurrency", "x"], "bench.py: argument --concurrency: invalid int"),
    (["bench.py", "--mesh-url", NOWHERE + "/v1"], "bench.py: the mesh is not answering at"),
    (["bench_adapters.py", "--max-resident", "x"],
     "bench_adapters.py: argument --max-resident: invalid int"),
    (["demo_requests.py", "--base-url", NOWHERE + "/v1"],
     f"demo_requests.py: the mesh does not answer at {NOWHERE}/v1"),
    (["drill_overload.py", "--compare", "--config", "nope.yaml"],
     "drill_overload.py: FileNotFoundError: No such file or directory: nope.yaml"),
    (["prepare_model.py", "--merge-adapter", "nope@v1", "--out", "/tmp/nope"],
     "prepare_model.py: nope@v1 is not in the adapter registry"),
    (["prepare_model.py", "--merge-adapter", "nope@v1"],
     "prepare_model.py: --merge-adapter needs --out DIR"),
    (["train_adapter.py", "--name", "x", "--version", "0", "--behaviour", "nope"],
     "train_adapter.py: argument --behaviour: invalid choice: 'nope'"),
])
def test_scripts_say_what_was_wrong_in_one_line(argv, line):
    res = run_script(sys.executable, str(REPO_ROOT / "scripts" / argv[0]), *argv[1:])
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert one_line(res.stderr).startswith(line), res.stderr


@pytest.mark.parametrize("argv, line", [
    (["demo.sh", "nope.yaml"], "demo.sh: no config file nope.yaml"),
    (["setup.sh", "--bogus"], "setup.sh: unknown argument '--bogus'"),
    (["stop.sh", "--bogus"], "stop.sh: unrecognized arguments: --bogus"),
])
def test_shell_scripts_refuse_bad_arguments_in_one_line(argv, line):
    res = run_script(str(REPO_ROOT / "scripts" / argv[0]), *argv[1:])
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert one_line(res.stderr).startswith(line), res.stderr
