"""Unit tests (no Ray cluster) of the base-model swap plan (:mod:`serve_app.release.swap`):
the plan's steps, weights and applications, its refusals, ``--steps``, the files it writes
and ``meshctl swap``. The restart / in-place report it relies on: test_config_diff.py."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml, mesh_parts
from serve_app.release.config_diff import ADDED, IN_PLACE, REMOVED, diff_configs
from serve_app.release.swap import SwapError, parse_steps, plan_swap, write_plan
from serve_app.release.validate import validate_config

CONFIGS = REPO_ROOT / "serve_configs"
LOCAL = load_yaml(CONFIGS / "local.yaml")
SWAP = dict(route="smollm", new_app="smollm-acme", model="smollm2-135m-acme")


def names(cfg):
    return [a["name"] for a in cfg["applications"]]


def route_variants(cfg, route="smollm"):
    return mesh_parts(cfg).router_user_config["routes"][route]["variants"]


def test_swap_plan_steps_weights_and_applications():
    original = copy.deepcopy(LOCAL)
    plan = plan_swap(LOCAL, steps=[50, 100], **SWAP)
    assert LOCAL == original  # the input is not modified
    assert [s.name for s in plan] == ["add", "weight-50", "weight-100", "retire"]
    assert [s.filename(i) for i, s in enumerate(plan)] == [
        "01-add.yaml", "02-weight-50.yaml", "03-weight-100.yaml", "04-retire.yaml"]
    assert [route_variants(s.config) for s in plan] == [
        [{"application": "smollm-v1", "weight": 100}, {"application": "smollm-acme", "weight": 0}],
        [{"application": "smollm-v1", "weight": 50}, {"application": "smollm-acme", "weight": 50}],
        [{"application": "smollm-v1", "weight": 0}, {"application": "smollm-acme", "weight": 100}],
        [{"application": "smollm-acme", "weight": 100}],
    ]
    assert [s.weights for s in plan] == [
        {"smollm-v1": 100, "smollm-acme": 0}, {"smollm-v1": 50, "smollm-acme": 50},
        {"smollm-v1": 0, "smollm-acme": 100}, {"smollm-acme": 100}]
    assert [names(s.config) for s in plan] == [["mesh", "smollm-v1", "smollm-acme"]] * 3 + [
        ["mesh", "smollm-acme"]]
    assert [s.pause_after for s in plan] == [False, True, True, False]
    for s in plan:
        assert validate_config(s.config) == []
        assert s.config["http_options"] == LOCAL["http_options"]

    # The new variant is the old one with another model: same engine args, runtime_env,
    # deployments, route_prefix null.
    old_app = LOCAL["applications"][1]
    new_app = plan[-1].config["applications"][1]
    assert new_app["args"]["model"] == "smollm2-135m-acme"
    assert new_app["args"]["engine_args"] == old_app["args"]["engine_args"]
    assert {k: v for k, v in new_app.items() if k not in ("name", "args")} == \
        {k: v for k, v in old_app.items() if k not in ("name", "args")}
    assert new_app["route_prefix"] is None


def test_swap_new_variant_runs_with_surge():
    no_surge = copy.deepcopy(LOCAL)
    del no_surge["applications"][1]["deployments"][0]["max_surge_percent"]
    for source in (LOCAL, no_surge):
        plan = plan_swap(source, **SWAP)
        new = mesh_parts(plan[-1].config).variant_apps["smollm-acme"]
        assert new["deployments"][0]["max_surge_percent"] == 100


def test_swap_default_is_straight_blue_green():
    plan = plan_swap(LOCAL, **SWAP)
    assert [(s.name, s.weights) for s in plan] == [
        ("add", {"smollm-v1": 100, "smollm-acme": 0}),
        ("weight-100", {"smollm-v1": 0, "smollm-acme": 100}),
        ("retire", {"smollm-acme": 100})]


def test_swap_plan_never_restarts_a_running_replica():
    """Consecutive configs of a swap differ only by an added application, in-place updates
    and, at the end, a removed application."""
    plan = plan_swap(LOCAL, steps=[50, 100], **SWAP)
    configs = [LOCAL] + [s.config for s in plan]
    kinds = [sorted({c.kind for cs in diff_configs(a, b).values() for c in cs})
             for a, b in zip(configs, configs[1:])]
    assert kinds == [[ADDED, IN_PLACE], [IN_PLACE], [IN_PLACE], [IN_PLACE, REMOVED]]


def test_swap_refuses_adapters_trained_for_the_old_base():
    with pytest.raises(SwapError) as e:
        plan_swap(load_yaml(CONFIGS / "tenants.yaml"), **SWAP)
    message = str(e.value)
    assert message.startswith("the swap of route 'smollm' to 'smollm-acme' (model "
                              "'smollm2-135m-acme') gives invalid configs; nothing was applied. "
                              "01-add.yaml:\n")
    assert ("  applications[2].deployments[LLMReplica].user_config.adapters[0]: acme-support@v1 "
            "cannot be served: trained for 'smollm2-135m-instruct', but this variant serves "
            "'smollm2-135m-acme'; declare it on a variant of 'smollm2-135m-instruct'\n"
            in message)
    assert "also invalid: 02-weight-100.yaml (2 problems), 03-retire.yaml (2 problems)" in message
    assert "copies args and user_config from 'smollm-v1'" in message


def test_swap_refuses_a_route_under_rollout():
    cfg = copy.deepcopy(LOCAL)
    mesh_parts(cfg).router_user_config["routes"]["smollm"]["rollout"] = {"steps": [10, 100]}
    with pytest.raises(SwapError) as e:
        plan_swap(cfg, **SWAP)
    assert str(e.value) == (
        "route 'smollm' has a progressive rollout (routes.smollm.rollout); a swap would fight "
        "it over the weights: finish or abort the rollout and remove its `rollout:` key, or "
        "release the new variant with the rollout")


def test_swap_needs_one_serving_variant_and_a_new_name():
    canary = load_yaml(CONFIGS / "canary.yaml")  # smollm-v1 90, smollm-v2 10
    with pytest.raises(SwapError, match=r"route 'smollm' has 2 variants with a positive weight "
                                        r"\(smollm-v1, smollm-v2\); a swap starts from exactly "
                                        r"one: finish the canary release first"):
        plan_swap(canary, **SWAP)
    with pytest.raises(SwapError, match="route 'nope' is not in the router's user_config.routes "
                                        r"\(routes: smollm\)"):
        plan_swap(LOCAL, **{**SWAP, "route": "nope"})
    with pytest.raises(SwapError, match="application 'smollm-v1' already exists"):
        plan_swap(LOCAL, **{**SWAP, "new_app": "smollm-v1"})
    with pytest.raises(SwapError, match="--from-app 'mesh' is not a variant application"):
        plan_swap(LOCAL, from_app="mesh", **SWAP)


def test_swap_from_app_retires_every_old_variant():
    """--from-app copies another variant; a zero-weight variant of the route retires too."""
    canary = load_yaml(CONFIGS / "canary.yaml")
    route_variants(canary)[0]["weight"], route_variants(canary)[1]["weight"] = 100, 0
    plan = plan_swap(canary, from_app="smollm-v2", steps=[50, 100], **SWAP)
    assert plan[1].weights == {"smollm-v1": 50, "smollm-v2": 0, "smollm-acme": 50}
    assert names(plan[-1].config) == ["mesh", "smollm-acme"]
    new_app = plan[-1].config["applications"][1]
    assert new_app["deployments"] == canary["applications"][2]["deployments"]  # v2's user_config


@pytest.mark.parametrize("text,steps", [("100", [100]), ("10, 50,100", [10, 50, 100])])
def test_parse_steps(text, steps):
    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["50", "50,40,100", "0,100", "50,150", "x", ""])
def test_parse_steps_refused(text):
    with pytest.raises(SwapError, match="--steps"):
        parse_steps(text)


def test_write_plan(tmp_path):
    plan = plan_swap(LOCAL, steps=[50, 100], **SWAP)
    paths = write_plan(plan, tmp_path / "swap")
    assert [p.name for p in paths] == ["01-add.yaml", "02-weight-50.yaml", "03-weight-100.yaml",
                                       "04-retire.yaml"]
    assert [load_yaml(p) for p in paths] == [s.config for s in plan]


def test_cli_swap_emit_and_refusal(tmp_path):
    cli = [sys.executable, "-m", "serve_app.cli", "swap"]
    res = subprocess.run(cli + [str(CONFIGS / "local.yaml"), "--route", "smollm", "--new-app",
                                "smollm-acme", "--model", "smollm2-135m-acme", "--steps",
                                "50,100", "--emit", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "01-add.yaml", "02-weight-50.yaml", "03-weight-100.yaml", "04-retire.yaml"]
    assert f"the new desired state is {tmp_path / '04-retire.yaml'}" in res.stdout
    res = subprocess.run(cli + [str(CONFIGS / "tenants.yaml"), "--route", "smollm", "--new-app",
                                "smollm-acme", "--model", "smollm2-135m-acme", "--emit",
                                str(tmp_path / "no")], capture_output=True, text=True)
    assert res.returncode == 1
    assert "acme-support@v1 cannot be served: trained for 'smollm2-135m-instruct'" in res.stderr
    assert not (tmp_path / "no").exists()
