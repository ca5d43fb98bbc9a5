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
                                                  "test.sh", "install_git_hooks.sh")] + [
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
    (["bench.py", "--adapters", "--max-resident", "x"],
     "bench.py: argument --max-resident: invalid int"),
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


@pytest.mark.parametrize("argv, mode, size", [
    (["--adapters"], "adapters", 16),
    (["--adapters", "8", "--max-resident", "2"], "adapters", 8),
    (["--sessions", "--turns", "3"], "sessions", 24),
    (["--sim"], "sim", "h100-llama3-8b"),
    (["--sim", "cpu-smollm2", "--small"], "sim", "cpu-smollm2"),
])
def test_a_bench_mode_without_its_size_runs_the_documented_one(argv, mode, size):
    """``bench.py --adapters``, ``--sessions`` and ``--sim`` alone run the size of their
    table in docs/benchmarks.md and docs/scale.md (16 adapters, 24 sessions, h100-llama3-8b)."""
    from bench.cli import build_parser

    assert getattr(build_parser(None).parse_args(argv), mode) == size


@pytest.mark.parametrize("argv, line", [
    (["demo.sh", "nope.yaml"], "demo.sh: no config file nope.yaml"),
    (["setup.sh", "--bogus"], "setup.sh: unknown argument '--bogus'"),
    (["stop.sh", "--bogus"], "stop.sh: unrecognized arguments: --bogus"),
])
def test_shell_scripts_refuse_bad_arguments_in_one_line(argv, line):
    res = run_script(str(REPO_ROOT / "scripts" / argv[0]), *argv[1:])
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert one_line(res.stderr).startswith(line), res.stderr


# -- values that cannot work: refused, naming the field or file ---------------------------------

def written(tmp_path, base: str, change) -> str:
    """``base`` (a shipped config) with ``change(config)`` applied, as a file."""
    cfg = copy.deepcopy(load_yaml(base))
    change(cfg)
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def router_uc(cfg):
    return cfg["applications"][0]["deployments"][0]["user_config"]


def test_a_negative_replica_count_is_one_plain_line(tmp_path, capsys):
    """Serve's ``num_replicas: PositiveInt | str`` gave one line per union member, each under
    pydantic's member name (``num_replicas.constrained-int``, ``num_replicas.str``)."""
    path = written(tmp_path, LOCAL, lambda c: c["applications"][1]["deployments"][0].update(
        num_replicas=-1))
    got, err = meshctl(["validate", path, "--skip-engine-check"], capsys)
    assert got == 1
    assert err.splitlines() == [f"{path}: INVALID", "  applications.1.deployments.0."
                                "num_replicas: Input should be greater than 0"]


def test_pydantic_errors_are_field_paths_and_plain_messages():
    from pydantic import BaseModel, PositiveInt, ValidationError, field_validator

    from serve_app.common.errors import format_validation_error

    class Model(BaseModel):
        count: PositiveInt | str
        sizes: dict[str, int | list[int]]

        @field_validator("count")
        @classmethod
        def _auto(cls, v):
            if isinstance(v, str) and v != "auto":
                raise ValueError(f"count must be a number or 'auto', not {v!r}")
            return v

    data = {"count": "lots", "sizes": {"int": "x"}}  # a key named like a union member
    with pytest.raises(ValidationError) as e:
        Model.model_validate(data)
    assert format_validation_error(e.value, "cfg", data).splitlines() == [
        "cfg.count: count must be a number or 'auto', not 'lots'",
        "cfg.sizes.int: Input should be a valid integer, unable to parse string as an integer "
        "or a valid list"]


def test_a_binary_file_is_named(tmp_path, capsys):
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)))
    got, err = meshctl(["validate", str(path)], capsys)
    assert got == 2
    assert one_line(err) == (f"meshctl validate: {path}: not a text file: byte 128 is not UTF-8 "
                             "(a Serve config is YAML text; is this the file you meant?)")


@pytest.mark.parametrize("image", ["bad image!", "Model-Mesh:1", "mesh:", "mesh::1",
                                   "registry.example.com/mesh@sha256:abc", "a" * 256, " "])
def test_kuberay_refuses_an_image_that_is_not_a_reference(image, tmp_path, capsys):
    out = tmp_path / "rayservice.yaml"
    got, err = meshctl(["kuberay", LOCAL, "--image", image, "-o", str(out)], capsys)
    assert got == 1 and not out.exists(), err
    assert "  image: " in err and "Traceback" not in err


@pytest.mark.parametrize("image", ["model-mesh:latest", "ubuntu:22.04", "localhost/mesh",
                                   "registry.example.com:5000/team/model-mesh:1.0",
                                   "ghcr.io/org/mesh@sha256:" + "a" * 64, "[::1]:5000/m:v1"])
def test_kuberay_takes_any_image_reference(image):
    from serve_app.release.kuberay import image_problem

    assert image_problem(image) is None


def test_a_daily_budget_below_the_minute_budget_is_refused_naming_both(tmp_path, capsys):
    def swap(cfg):
        initech = next(t for t in router_uc(cfg)["tenants"] if t["id"] == "initech")
        initech.update(tokens_per_minute=10_000, tokens_per_day=5_000)
    path = written(tmp_path, TENANTS, swap)
    got, err = meshctl(["validate", path, "--skip-engine-check"], capsys)
    assert got == 1
    assert (f"{path}: INVALID\n  applications[0].deployments[MeshRouter].user_config.tenants.3: "
            "tenant 'initech': tokens_per_day (5000) is below tokens_per_minute (10000)") in err


def test_an_actor_ledger_with_a_redis_url_is_refused_naming_the_field(tmp_path, capsys):
    path = written(tmp_path, TENANTS, lambda c: router_uc(c).update(
        ledger={"backend": "actor", "redis_url": "redis://127.0.0.1:6379/0"}))
    got, err = meshctl(["validate", path, "--skip-engine-check"], capsys)
    assert got == 1
    assert ("user_config.ledger: ledger.redis_url 'redis://127.0.0.1:6379/0' is set but "
            "ledger.backend is actor") in err and "set backend: redis, or remove redis_url" in err


def test_the_engine_check_says_how_long_it_takes_once(monkeypatch, capsys):
    """--help and a progress line before vLLM is imported give the same time; a second file
    needs no second import, and no line."""
    from serve_app.release import engine_check

    parser = cli.build_parser()
    validate = next(a for a in parser._subparsers._group_actions[0].choices["validate"]._actions
                    if "--skip-engine-check" in a.option_strings)
    assert engine_check.VLLM_IMPORT_TIME in validate.help
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    calls = []

    def check(config, offline=None):
        calls.append(config)
        monkeypatch.setitem(sys.modules, "vllm", object())  # what a real check leaves
        return [], []
    monkeypatch.setattr(engine_check, "engine_problems", check)
    assert cli.main(["validate", LOCAL, TENANTS]) == 0
    err = capsys.readouterr().err
    assert len(calls) == 2
    assert err.count("meshctl: asking vLLM about the engine args (importing it takes "
                     f"{engine_check.VLLM_IMPORT_TIME}") == 1, err
