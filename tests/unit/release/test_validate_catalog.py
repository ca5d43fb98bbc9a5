"""Every bad config of ``tests/support/config_catalog.py`` and
``tests/support/gpu_config_catalog.py`` gets exactly its problem from ``meshctl validate``
(the mesh's checks, then vLLM's verdict on engine args, offline), and nothing else; the CLI
exits 1 with it on stderr, and no command (validate, kuberay) prints a traceback. No Ray
cluster, no engine, no network."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from tests.support.config_catalog import CASES as CATALOG
from tests.support.config_catalog import Case, models_here
from tests.support.gpu_config_catalog import GPU_CASES
from serve_app.common.paths import REPO_ROOT, models_dir
from serve_app.common.serve_configs import load_yaml
from serve_app.release.engine_check import engine_problems
from serve_app.release.validate import validate_config


CASES = [*CATALOG, *GPU_CASES]


def base_path(base: str):
    """A case's base: a shipped config by name, or a repository path."""
    return REPO_ROOT / base if "/" in base else REPO_ROOT / "serve_configs" / base


def bad_config(case: Case, tmp_path) -> dict:
    cfg = copy.deepcopy(load_yaml(base_path(case.base)))
    for app in cfg["applications"]:  # the base's registry, wherever the copy is written
        for dep in app.get("deployments") or []:
            uc = dep.get("user_config") or {}
            if uc.get("adapters_manifest"):
                uc["adapters_manifest"] = str(REPO_ROOT / uc["adapters_manifest"])
    case.mutate(cfg, tmp_path)
    return cfg


def expected(case: Case, tmp_path) -> str:
    return case.problem.format(models=models_dir(), tmp=tmp_path, repo=REPO_ROOT,
                               models_here=models_here())


def problems_of(cfg: dict) -> list[str]:
    problems = validate_config(cfg)
    return problems or engine_problems(cfg, offline=True)[0]


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
    cfg = load_yaml(base_path(base))
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


def gpu_or_source(case: Case) -> bool:
    """A case about where weights come from or where an engine runs: its problem is in a
    variant's args (model, revision, engine args, accelerator) or its LLMReplica deployment
    (resources, placement group, adapters)."""
    path = case.problem.split(": ", 1)[0]
    return ".args" in path or "deployments[LLMReplica]" in path


def test_the_catalog_holds_56_gpu_and_source_configs():
    assert len([c for c in CASES if gpu_or_source(c)]) >= 56


def test_the_cli_refuses_every_gpu_and_source_config_offline(tmp_path):
    """One `meshctl validate --offline` of them all: exit 1, each file INVALID with its
    problem, no traceback."""
    cases = [c for c in CASES if gpu_or_source(c)]
    paths, scratch = [], []
    for i, case in enumerate(cases):
        scratch.append(tmp_path / str(i))  # a case's own files (an adapter registry)
        scratch[-1].mkdir()
        paths.append(tmp_path / f"{i}.yaml")
        paths[-1].write_text(yaml.safe_dump(bad_config(case, scratch[-1]), sort_keys=False))
    res = subprocess.run([sys.executable, "-m", "serve_app.cli", "validate", "--offline",
                          *map(str, paths)], capture_output=True, text=True, timeout=600,
                         cwd=REPO_ROOT)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    for path, case, folder in zip(paths, cases, scratch):
        want = expected(case, folder)
        want = want[:-3] if want.endswith("...") else want + "\n"
        assert f"{path}: INVALID\n  {want}" in res.stderr, (case.name, res.stderr[-3000:])
    assert res.stdout.count(": ok") == 0


@pytest.mark.parametrize("case", [c for c in CASES if not c.engine],
                         ids=[c.name for c in CASES if not c.engine])
def test_kuberay_refuses_each_config_validate_refuses(case, tmp_path):
    """`meshctl kuberay` runs the same checks first: the same problem, no manifest, no
    traceback (``num_gpus: "1"`` used to end in a TypeError there)."""
    from serve_app.release.kuberay import ManifestError, rayservice_manifest

    with pytest.raises(ManifestError) as e:
        rayservice_manifest(bad_config(case, tmp_path))
    want = expected(case, tmp_path)
    got = e.value.problems[0]
    assert got.startswith(want[:-3]) if want.endswith("...") else got == want
