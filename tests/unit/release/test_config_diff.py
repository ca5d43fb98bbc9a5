"""Unit tests (no Ray cluster) of the restart / in-place change report
(:mod:`serve_app.release.config_diff`): which change restarts a replica and which applies in
place (checked against Serve's own code version over every shipped config pair), the report's
lines as people read them, and ``meshctl diff`` / ``validate --against``. The swap plan built
on it: test_swap.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml, mesh_parts
from serve_app.release.change_lines import report_lines
from serve_app.release.config_diff import (ADDED, IN_PLACE, RESTART, UNSET, Change, diff_configs,
                                           format_report, restarts)
from serve_app.release.deploy import live_config

CONFIGS = REPO_ROOT / "serve_configs"
LOCAL = load_yaml(CONFIGS / "local.yaml")


def route_variants(cfg, route="smollm"):
    return mesh_parts(cfg).router_user_config["routes"][route]["variants"]


# ---------------------------------------------------------------------------------------------
# change report
# ---------------------------------------------------------------------------------------------

def variant(cfg):
    return cfg["applications"][1]


def replica_dep(cfg):
    return variant(cfg)["deployments"][0]


def one_change(mutate) -> Change:
    new = copy.deepcopy(LOCAL)
    mutate(new)
    report = diff_configs(LOCAL, new)
    [change] = [c for cs in report.values() for c in cs]
    return change


def test_args_change_restarts_with_a_readable_line():
    change = one_change(lambda c: variant(c)["args"]["engine_args"].update(max_num_seqs=6))
    assert change == Change("smollm-v1", "args.engine_args.max_num_seqs", RESTART, 8, 6,
                            "application args change replaces every replica")
    assert str(change) == ("smollm-v1: args.engine_args.max_num_seqs 8 -> 6: RESTART "
                           "(application args change replaces every replica)")


@pytest.mark.parametrize("mutate,field", [
    (lambda c: variant(c)["args"].update(model="smollm2-135m-acme"), "args.model"),
    (lambda c: variant(c)["runtime_env"]["env_vars"].update(VLLM_CPU_KVCACHE_SPACE="2"),
     "runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE"),
    (lambda c: variant(c).update(import_path="other:app"), "import_path"),
    (lambda c: replica_dep(c).update(ray_actor_options={"num_cpus": 1}),
     "deployments[LLMReplica].ray_actor_options"),
    (lambda c: replica_dep(c).update(placement_group_bundles=[{"CPU": 1}]),
     "deployments[LLMReplica].placement_group_bundles"),
    (lambda c: replica_dep(c).update(made_up_option=1), "deployments[LLMReplica].made_up_option"),
])
def test_restart_fields(mutate, field):
    change = one_change(mutate)
    assert (change.app, change.field, change.kind) == ("smollm-v1", field, RESTART)


@pytest.mark.parametrize("option,value", [
    ("user_config", {"system_prompt": "Be brief."}),
    ("num_replicas", 2),
    ("max_ongoing_requests", 8),
    ("graceful_shutdown_timeout_s", 60),
    ("graceful_shutdown_wait_loop_s", 1),
    ("health_check_period_s", 5),
    ("health_check_timeout_s", 60),
])
def test_lightweight_deployment_options_are_in_place(option, value):
    new = copy.deepcopy(LOCAL)
    replica_dep(new)[option] = value
    [changes] = diff_configs(LOCAL, new).values()
    assert changes and {c.kind for c in changes} == {IN_PLACE}
    assert all(c.field.startswith(f"deployments[LLMReplica].{option}") for c in changes)


def test_autoscaling_config_in_place_but_its_policy_or_adding_one_restarts():
    """Serve 2.60 hashes the list of deployments' autoscaling policies into the code version:
    adding a whole autoscaling_config (a None policy joins the list) or changing its policy
    restarts the application; its other fields are in place."""
    scaled = copy.deepcopy(LOCAL)
    replica_dep(scaled)["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2}
    assert {c.kind for c in diff_configs(LOCAL, scaled)["smollm-v1"]} == {RESTART}
    more = copy.deepcopy(scaled)
    replica_dep(more)["autoscaling_config"]["max_replicas"] = 3
    [change] = diff_configs(scaled, more)["smollm-v1"]
    assert (change.field, change.kind) == (
        "deployments[LLMReplica].autoscaling_config.max_replicas", IN_PLACE)
    policy = copy.deepcopy(scaled)
    replica_dep(policy)["autoscaling_config"]["policy"] = {
        "policy_function": "serve_app.control.resident_policy:resident_policy"}
    [change] = diff_configs(scaled, policy)["smollm-v1"]
    assert (change.field, change.kind) == (
        "deployments[LLMReplica].autoscaling_config.policy", RESTART)


def test_request_router_config_restarts_the_application():
    """Issue 26: `meshctl diff live affinity.yaml` said IN PLACE; Serve replaced the replica."""
    change = one_change(lambda c: replica_dep(c).update(request_router_config={
        "request_router_class": "serve_app.replica_routing.router:AffinityRouter"}))
    assert (change.field, change.kind) == ("deployments[LLMReplica].request_router_config",
                                           RESTART)


def test_restart_verdicts_match_serves_code_version_over_every_shipped_config_pair():
    """For every ordered pair of shipped configs and every application in both, the diff says
    RESTART at the application level exactly when Serve's own get_app_code_version changes
    (deployment-level restarts, e.g. ray_actor_options, are Serve's DeploymentVersion's and
    come on top)."""
    from serve_app.release.config_diff import code_version
    from serve_app.common.serve_configs import applications

    configs = {p.name: load_yaml(p) for p in sorted(CONFIGS.glob("*.yaml"))}
    app_level = ("import_path", "args", "runtime_env", "autoscaling_policy", "code version")
    compared = 0
    for a_name, a in configs.items():
        for b_name, b in configs.items():
            old_apps = {x["name"]: x for x in applications(a)}
            report = diff_configs(a, b)
            for app in applications(b):
                if app["name"] not in old_apps:
                    continue
                serve_restarts = code_version(old_apps[app["name"]]) != code_version(app)
                ours = any(c.kind == RESTART and (c.field.split(".")[0] in app_level
                                                  or ".request_router_config" in c.field
                                                  or ".autoscaling_config" in c.field
                                                  or ".deployment_actors" in c.field)
                           for c in report.get(app["name"], []))
                assert ours == serve_restarts, (a_name, b_name, app["name"],
                                                format_report({app["name"]:
                                                               report.get(app["name"], [])}))
                compared += 1
    assert compared > 50


def test_route_prefix_and_weights_in_place():
    change = one_change(lambda c: variant(c).update(route_prefix="/v1-direct"))
    assert (change.field, change.kind, change.old, change.new) == (
        "route_prefix", IN_PLACE, None, "/v1-direct")
    change = one_change(lambda c: route_variants(c)[0].update(weight=50))
    assert change.app == "mesh" and change.kind == IN_PLACE
    assert change.field == "deployments[MeshRouter].user_config.routes.smollm.variants"
    assert "lightweight update: reconfigure() on the running replicas" in str(change)


def test_added_removed_and_unset():
    canary = load_yaml(CONFIGS / "canary.yaml")
    report = diff_configs(LOCAL, canary)
    assert list(report) == ["mesh", "smollm-v2"]
    assert [c.kind for c in report["smollm-v2"]] == [ADDED]
    tenants = next(c for c in report["mesh"] if c.field.endswith(".tenants"))
    assert tenants.old is UNSET and str(tenants).startswith(
        "mesh: deployments[MeshRouter].user_config.tenants (unset) -> [")
    back = diff_configs(canary, LOCAL)
    assert [str(c) for c in back["smollm-v2"]] == [
        "smollm-v2: REMOVED (Serve lets its in-flight requests finish "
        "(graceful_shutdown_timeout_s), then stops its replicas)"]
    assert restarts(report) == restarts(back) == []
    assert diff_configs(LOCAL, copy.deepcopy(LOCAL)) == {}
    assert format_report({}) == ["no changes"]


def test_live_config_from_the_dashboard(monkeypatch):
    """`live` is the applications' deployed_app_config from GET /api/serve/applications/."""
    status = {"applications": {
        "mesh": {"deployed_app_config": LOCAL["applications"][0]},
        "smollm-v1": {"deployed_app_config": LOCAL["applications"][1]},
        "made-in-python": {"deployed_app_config": None}}}
    monkeypatch.setattr("serve_app.release.deploy.serve_status", lambda dashboard: status)
    assert live_config("http://dash") == {"applications": LOCAL["applications"]}
    monkeypatch.setattr("serve_app.release.deploy.serve_status", lambda dashboard: {
        "applications": {}})
    with pytest.raises(ValueError, match="no application at http://dash was deployed"):
        live_config("http://dash")


def test_cli_diff_and_validate_against(tmp_path):
    new = copy.deepcopy(LOCAL)
    variant(new)["args"]["engine_args"]["max_num_seqs"] = 6
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(new, sort_keys=False))
    old = str(CONFIGS / "local.yaml")
    line = ("smollm-v1: args.engine_args.max_num_seqs 8 -> 6: RESTART (application args change "
            "replaces every replica)")

    def meshctl(*args):
        return subprocess.run([sys.executable, "-m", "serve_app.cli", *args,
                               "--skip-engine-check"], capture_output=True, text=True)

    res = meshctl("diff", old, str(path))
    assert res.returncode == 0 and f"  {line}\n" in res.stdout
    res = meshctl("diff", old, str(path), "--fail-on-restart")
    assert res.returncode == 1 and "REFUSED: the 1 RESTART change(s) above" in res.stderr
    res = meshctl("validate", str(path), "--against", old)
    assert res.returncode == 1
    assert "new.yaml: REFUSED: the 1 RESTART change(s) above restart replicas.\n" in res.stderr
    assert (res.stdout + res.stderr).count(line) == 1  # each restart line once
    assert (f"meshctl swap {old} --route smollm --new-app smollm-v1-next --engine-arg "
            "max_num_seqs=6") in res.stderr
    assert meshctl("validate", str(path), "--against", old, "--allow-restart").returncode == 0
    res = meshctl("validate", str(CONFIGS / "canary.yaml"), "--against", old)
    assert res.returncode == 0 and "  smollm-v2: ADDED" in res.stdout


def test_the_swap_hint_carries_a_new_model_and_engine_args():
    new = copy.deepcopy(LOCAL)
    variant(new)["args"]["model"] = "smollm2-135m-acme"
    variant(new)["args"]["engine_args"]["structured_outputs_config"] = {"backend": "xgrammar"}
    del variant(new)["args"]["engine_args"]["enforce_eager"]
    from serve_app.commands.check import blue_green_hint

    hint = blue_green_hint("live", new, restarts(diff_configs(LOCAL, new)))
    assert ("meshctl swap CURRENT_CONFIG --route smollm --new-app smollm-v1-next --model "
            "smollm2-135m-acme --engine-arg enforce_eager=null --engine-arg "
            "'structured_outputs_config={backend: xgrammar}'") in hint
    variant(new)["runtime_env"] = {}
    hint = blue_green_hint("live", new, restarts(diff_configs(LOCAL, new)))
    assert "meshctl swap" not in hint and "copy the variant application" in hint


def test_cli_diff_validates_the_new_config_first(tmp_path):
    new = copy.deepcopy(LOCAL)
    route_variants(new)[0]["weight"] = -1
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(new, sort_keys=False))
    res = subprocess.run([sys.executable, "-m", "serve_app.cli", "diff",
                          str(CONFIGS / "local.yaml"), str(path), "--skip-engine-check"],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "IN PLACE" not in res.stdout
    assert "new.yaml: INVALID\n" in res.stderr and ".weight: Input should be greater" in res.stderr


# ---------------------------------------------------------------------------------------------
# the report as people read it: list items one by one, values whole
# ---------------------------------------------------------------------------------------------

def test_a_tenant_added_to_a_list_is_one_whole_line():
    tenants = load_yaml(CONFIGS / "tenants.yaml")
    new = copy.deepcopy(tenants)
    ops = {"id": "ops2", "api_keys_sha256": ["a" * 64], "routes": ["smollm"],
           "tokens_per_day": 500000}
    mesh_parts(new).router_user_config["tenants"].append(ops)
    [line] = report_lines(diff_configs(tenants, new))
    assert line == ("mesh: deployments[MeshRouter].user_config.tenants[id=ops2] (unset) -> "
                    + json.dumps(ops) + ": IN PLACE (lightweight update: reconfigure() on "
                    "the running replicas)")


def test_list_items_are_matched_by_their_names():
    canary = load_yaml(CONFIGS / "canary.yaml")
    new = copy.deepcopy(canary)
    variants = route_variants(new)
    variants[1]["weight"] = 50
    tenant = mesh_parts(new).router_user_config["tenants"][0]
    tenant["api_keys_sha256"] = [*tenant["api_keys_sha256"], "b" * 64]
    lines = report_lines(diff_configs(canary, new))
    prefix = "mesh: deployments[MeshRouter].user_config"
    assert f"{prefix}.routes.smollm.variants[application=smollm-v2].weight 10 -> 50" in \
        lines[0]
    assert any(line.startswith(f"{prefix}.tenants[id={tenant['id']}].api_keys_sha256[+] "
                               f"(unset) -> {'b' * 64}: IN PLACE") for line in lines), lines
    variants.reverse()
    lines = report_lines(diff_configs(canary, new))
    assert any(".variants order [\"application=smollm-v1\", \"application=smollm-v2\"] -> "
               "[\"application=smollm-v2\", \"application=smollm-v1\"]" in line
               for line in lines), lines


def test_adapters_by_name_and_version_and_nothing_cut_short():
    tenants = load_yaml(CONFIGS / "tenants.yaml")
    new = copy.deepcopy(tenants)
    replica = variant_named(new, "smollm-v1")["deployments"][0]["user_config"]
    replica["adapters"].append({"name": "acme-support", "version": 2})
    replica["system_prompt"] = "x" * 200
    lines = report_lines(diff_configs(tenants, new))
    assert any("user_config.adapters[name=acme-support,version=2] (unset) -> "
               '{"name": "acme-support", "version": 2}' in line for line in lines), lines
    assert any("x" * 200 in line for line in lines)
    assert report_lines({}) == ["no changes"]


def variant_named(cfg, name):
    return next(a for a in cfg["applications"] if a["name"] == name)


def test_top_level_logging_config_is_each_applications_default():
    """Serve writes the top-level logging_config into every application of the live config:
    the shipped file and the live config it became are the same config."""
    default = {"additional_log_standard_attrs": ["name"]}
    given = {**copy.deepcopy(LOCAL), "logging_config": default}
    live = copy.deepcopy(LOCAL)
    for app in live["applications"]:
        app["logging_config"] = copy.deepcopy(default)
    assert diff_configs(given, live) == {} and diff_configs(live, given) == {}
    own = copy.deepcopy(given)
    variant(own)["logging_config"] = {"log_level": "DEBUG"}  # an application's own wins
    bare = {"applications": [{"name": "a", "import_path": "x:y"}]}  # none anywhere
    assert diff_configs(bare, copy.deepcopy(bare)) == {}
    changes = diff_configs(given, own)["smollm-v1"]
    assert changes and all(c.field.startswith("logging_config") and c.kind == IN_PLACE
                           for c in changes), changes
