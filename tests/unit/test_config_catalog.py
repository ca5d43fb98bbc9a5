"""Every bad config of ``tests/support/config_catalog.py`` gets exactly its problem from
``meshctl validate`` (the mesh's checks, then vLLM's verdict on engine args), and nothing
else; the CLI exits 1 with it on stderr. No Ray cluster, no engine."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from tests.support.config_catalog import CASES, Case, models_here
from serve_app.common.paths import REPO_ROOT, models_dir
from serve_app.common.serve_configs import load_yaml
from serve_app.release.engine_check import engine_problems
from serve_app.release.validate import validate_config


def bad_config(case: Case, tmp_path) -> dict:
    cfg = copy.deepcopy(load_yaml(REPO_ROOT / "serve_configs" / case.base))
    case.mutate(cfg, tmp_path)
    return cfg


def expected(case: Case, tmp_path) -> str:
    return case.problem.format(models=models_dir(), tmp=tmp_path, repo=REPO_ROOT,
                               models_here=models_here())


def problems_of(cfg: dict) -> list[str]:
    problems = validate_config(cfg)
    return problems or engine_problems(cfg)[0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_bad_config_gets_its_message(case, tmp_path):
    problems = problems_of(bad_config(case, tmp_path))
    want = expected(case, tmp_path)
    assert len(problems) == case.count, problems
    if want.endswith("..."):
        assert problems[0].startswith(want[:-3]), problems[0]
    else:
        assert problems[0] == want
    assert (validate_config(bad_config(case, tmp_path)) == []) == case.engine  # who refuses


@pytest.mark.parametrize("base", sorted({c.base for c in CASES}))
def test_the_bases_are_valid(base):
    """A case's one change is what makes it bad."""
    cfg = load_yaml(REPO_ROOT / "serve_configs" / base)
    assert problems_of(cfg) == []


def test_the_cli_refuses_with_the_message(tmp_path):
    """`meshctl validate` on a file of each kind: exit 1, ``path: INVALID`` and the problem."""
    paths, wants = [], []
    for case in (c for c in CASES if c.name in (
            "a model directory that does not exist", "a dtype vLLM does not know",
            "a tenant owning a misspelled adapter", "a daily token budget below the "
            "smallest request")):
        path = tmp_path / f"{len(paths)}.yaml"
        path.write_text(yaml.safe_dump(bad_config(case, tmp_path), sort_keys=False))
        paths.append(str(path))
        wants.append(expected(case, tmp_path))
    res = subprocess.run([sys.executable, "-m", "serve_app.cli", "validate", *paths],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    for path, want in zip(paths, wants):
        assert f"{path}: INVALID\n  {want}\n" in res.stderr, res.stderr


def test_a_simulated_engine_is_flagged():
    """Valid (tests and benchmarks run it), but never what a shipped config serves."""
    from serve_app.release.validate import config_warnings

    cfg = copy.deepcopy(load_yaml(REPO_ROOT / "serve_configs" / "local.yaml"))
    cfg["applications"][1]["args"]["engine"] = "sim"
    assert validate_config(cfg) == []
    [warning] = config_warnings(cfg)
    assert warning.startswith("applications[1].args.engine: variant 'smollm-v1' runs the "
                              "simulated engine")
