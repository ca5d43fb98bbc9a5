"""Unit tests of config validation (pure logic): each bad case names its field and the fix."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from serve_app.common.config import RouterConfig
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.tenancy.keys import authenticate, hash_api_key
from serve_app.common.errors import MeshError
from serve_app.release.validate import config_warnings, validate_config
from tests.support.serve_config import router_uc

CANARY = load_yaml(REPO_ROOT / "serve_configs" / "canary.yaml")
ROUTER = "applications[0].deployments[MeshRouter].user_config"


@pytest.mark.parametrize("name", ["local.yaml", "canary.yaml", "rollout.yaml", "tenants.yaml",
                                  "shadow.yaml"])
def test_shipped_configs_are_valid(name):
    assert validate_config(load_yaml(REPO_ROOT / "serve_configs" / name)) == []


def mutate(fn):
    cfg = copy.deepcopy(CANARY)
    fn(cfg)
    return validate_config(cfg)


def test_negative_weight():
    problems = mutate(lambda c: router_uc(c)["routes"]["smollm"]["variants"][1].update(weight=-1))
    assert problems == [f"{ROUTER}.routes.smollm.variants.1.weight: "
                        "Input should be greater than or equal to 0"]


def test_weights_sum_to_zero():
    def zero(c):
        for v in router_uc(c)["routes"]["smollm"]["variants"]:
            v["weight"] = 0
    [problem] = mutate(zero)
    assert problem.startswith(f"{ROUTER}.routes.smollm.variants: ")
    assert "weights sum to 0" in problem


def test_variant_missing_from_config():
    [problem] = mutate(lambda c: router_uc(c)["routes"]["smollm"]["variants"][1].update(
        application="smollm-v3"))
    assert problem == ("applications[0].deployments[MeshRouter].user_config.routes.smollm."
                       "variants[1].application: no variant application named 'smollm-v3' in "
                       "this config; add it or remove it from the route")


def test_duplicate_variant_in_route():
    [problem] = mutate(lambda c: router_uc(c)["routes"]["smollm"]["variants"][1].update(
        application="smollm-v1"))
    assert "variant listed twice: smollm-v1" in problem


def test_duplicate_application_names_refused_by_ray_schema():
    def dup(c):
        c["applications"][2]["name"] = "smollm-v1"
    [problem] = mutate(dup)
    assert "smollm-v1" in problem and "duplicate" in problem.lower()


def test_duplicate_yaml_keys_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("applications: []\napplications: []\n")
    with pytest.raises(ValueError, match="duplicate key 'applications'"):
        load_yaml(path)


def test_variant_exposed_over_http():
    def expose(c):
        c["applications"][1]["route_prefix"] = "/v1-direct"
    [problem] = mutate(expose)
    assert problem.startswith("applications[1].route_prefix: variant 'smollm-v1' must not be "
                              "exposed over HTTP")


def test_bad_route_prefix_format():
    def bad(c):
        c["applications"][0]["route_prefix"] = "no-slash"
    [problem] = mutate(bad)
    assert problem == ("applications[0].route_prefix: got 'no-slash'; the router needs a route "
                       "prefix that starts with '/' and does not end with '/' (usually '/')")


def test_served_model_name_must_match_route():
    def rename(c):
        c["applications"][2]["args"] = {**c["applications"][2]["args"],
                                         "served_model_name": "other"}
    [problem] = mutate(rename)
    assert "serves 'other'; set its args.served_model_name to 'smollm'" in problem


def test_unknown_field_in_router_config():
    [problem] = mutate(lambda c: router_uc(c).update(weights={"smollm-v1": 1}))
    assert problem == f"{ROUTER}.weights: Extra inputs are not permitted"


def test_plaintext_key_refused():
    [problem] = mutate(lambda c: router_uc(c)["tenants"][0].update(
        api_keys_sha256=["sk-mesh-ops-demo"]))
    assert "is not a SHA-256 hex digest" in problem and "meshctl hash-key" in problem


def test_tenant_unknown_route_and_shared_key():
    base = router_uc(CANARY)
    bad = {**base, "tenants": [{"id": "a", "api_keys_sha256": [hash_api_key("k")],
                                "routes": ["nope"]}]}
    with pytest.raises(ValueError, match="tenant 'a' names unknown route 'nope'"):
        RouterConfig.model_validate(bad)
    shared = {**base, "tenants": [{"id": "a", "api_keys_sha256": [hash_api_key("k")]},
                                  {"id": "b", "api_keys_sha256": [hash_api_key("k")]}]}
    with pytest.raises(ValueError, match="belongs to both 'a' and 'b'"):
        RouterConfig.model_validate(shared)


def test_authenticate():
    cfg = RouterConfig.model_validate(router_uc(CANARY))
    by_digest = cfg.tenant_by_key_digest()
    assert authenticate(by_digest, "Bearer sk-mesh-ops-demo").id == "ops"
    for header in (None, "Bearer ", "Basic sk-mesh-ops-demo", "Bearer wrong"):
        with pytest.raises(MeshError) as e:
            authenticate(by_digest, header)
        assert e.value.status == 401
    assert authenticate({}, None) is None  # open mode


def test_cli_validate_exit_codes(tmp_path):
    bad = copy.deepcopy(CANARY)
    router_uc(bad)["routes"]["smollm"]["variants"][0]["weight"] = -5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    cli = [sys.executable, "-m", "serve_app.cli", "validate"]
    good = subprocess.run(cli + [str(REPO_ROOT / "serve_configs" / "canary.yaml")],
                          capture_output=True, text=True)
    assert good.returncode == 0 and good.stdout.strip().endswith("canary.yaml: ok")
    res = subprocess.run(cli + [str(path)], capture_output=True, text=True)
    assert res.returncode == 1
    assert "bad.yaml: INVALID" in res.stderr
    assert "variants.0.weight: Input should be greater than or equal to 0" in res.stderr


def test_every_shipped_variant_runs_with_surge_and_validate_warns_without():
    for name in ("local.yaml", "canary.yaml", "rollout.yaml", "tenants.yaml", "shadow.yaml"):
        assert config_warnings(load_yaml(REPO_ROOT / "serve_configs" / name)) == [], name
    no_surge = copy.deepcopy(CANARY)
    no_surge["applications"][2]["deployments"][0]["max_surge_percent"] = 0
    [warning] = config_warnings(no_surge)
    assert warning.startswith("applications[2].deployments[LLMReplica].max_surge_percent: "
                              "variant 'smollm-v2' runs without surge replacement")
    assert warning.endswith("set max_surge_percent: 100")
    assert validate_config(no_surge) == []  # a warning, not a problem


def test_tenant_priority_and_route_admission():
    cfg = copy.deepcopy(CANARY)
    router_uc(cfg)["tenants"][0]["priority"] = -3
    router_uc(cfg)["routes"]["smollm"]["admission"] = {"queue_timeout_s": 5,
                                                        "reserved_slots": 2}
    assert validate_config(cfg) == []
    rc = RouterConfig.model_validate(router_uc(cfg))
    assert rc.top_priority() == -3
    assert rc.routes["smollm"].admission.max_queued_per_slot is None  # from service time
    router_uc(cfg)["routes"]["smollm"]["admission"]["queue_timeout_s"] = 0
    assert validate_config(cfg) == [f"{ROUTER}.routes.smollm.admission.queue_timeout_s: "
                                    "Input should be greater than 0"]


def test_cli_hash_key():
    out = subprocess.run([sys.executable, "-m", "serve_app.cli", "hash-key", "sk-acme-demo"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == hash_api_key("sk-acme-demo") == (
        "953d0ab8229abd463060e52204c8cb44e32297002500258c1181e18379c54626")


TENANTS = load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml")
REPLICA_UC = "applications[1].deployments[LLMReplica].user_config"


def test_adapter_for_another_base_model_refused():
    cfg = copy.deepcopy(TENANTS)
    cfg["applications"][1]["args"] = {**cfg["applications"][1]["args"], "model": "other-base"}
    problems = validate_config(cfg)
    assert (f"{REPLICA_UC}.adapters[0]: acme-support@v1 cannot be served: trained for "
            "'smollm2-135m-instruct', but this variant serves 'other-base'; declare it on a "
            "variant of 'smollm2-135m-instruct'") in problems


def test_adapter_checks_against_engine_args():
    cfg = copy.deepcopy(TENANTS)
    app = cfg["applications"][1]
    app["args"] = {**app["args"], "engine_args": {**app["args"]["engine_args"],
                                                  "max_lora_rank": 4}}
    assert (f"{REPLICA_UC}.adapters[0]: acme-support@v1 cannot be served: rank 8 is over this "
            "variant's max_lora_rank=4; raise max_lora_rank in the variant's engine args or "
            "retrain with r<=4" in validate_config(cfg))
    app["args"]["engine_args"]["enable_lora"] = False
    assert validate_config(cfg)[0] == (
        f"{REPLICA_UC}.adapters[0]: acme-support@v1 cannot be served: the variant's engine has "
        "LoRA off; set engine_args.enable_lora: true (an args change: do it blue/green)")
    app["deployments"][0]["user_config"]["adapters"].append({"name": "nope", "version": 3})
    app["args"]["engine_args"]["enable_lora"] = True
    app["args"]["engine_args"]["max_lora_rank"] = 8
    assert f"{REPLICA_UC}.adapters[2]: nope@v3 is not in the adapter registry" in \
        validate_config(cfg)


def test_max_adapters_per_replica_may_not_exceed_max_cpu_loras():
    cfg = copy.deepcopy(TENANTS)
    uc = cfg["applications"][1]["deployments"][0]["user_config"]
    uc["max_adapters_per_replica"] = 4  # tenants.yaml: max_cpu_loras 4
    assert validate_config(cfg) == []
    uc["max_adapters_per_replica"] = 5
    assert validate_config(cfg) == [
        f"{REPLICA_UC}.max_adapters_per_replica: 5 is over the engine's max_cpu_loras=4; raise "
        "args.engine_args.max_cpu_loras (an args change: new replicas) or lower "
        "max_adapters_per_replica"]


def test_adapter_listed_twice_and_owned_twice():
    cfg = copy.deepcopy(TENANTS)
    cfg["applications"][1]["deployments"][0]["user_config"]["adapters"].append(
        {"name": "acme-support", "version": 1})
    [problem] = validate_config(cfg)
    assert "adapter version listed twice: acme-support@v1" in problem
    cfg = copy.deepcopy(TENANTS)
    router_uc(cfg)["tenants"][2]["adapters"].append("acme-support")
    [problem] = validate_config(cfg)
    assert "adapter 'acme-support' is owned by both 'acme' and 'globex'" in problem


def test_adapter_of_the_instruct_base_refused_on_the_acme_base():
    """smollm2-135m-acme (acme-support@v1 merged in) is another base model: adapters trained
    for smollm2-135m-instruct are refused on it, e.g. when a base swap copies the adapter list."""
    cfg = copy.deepcopy(TENANTS)
    app = cfg["applications"][1]
    app["args"] = {**app["args"], "model": "smollm2-135m-acme"}
    app["deployments"][0]["user_config"]["adapters"] = [{"name": "acme-support", "version": 1}]
    router_uc(cfg)["tenants"][2]["adapters"] = []  # globex-report is no longer served
    assert validate_config(cfg) == [
        f"{REPLICA_UC}.adapters[0]: acme-support@v1 cannot be served: trained for "
        "'smollm2-135m-instruct', but this variant serves 'smollm2-135m-acme'; declare it on a "
        "variant of 'smollm2-135m-instruct'"]


def test_adapter_split_version_must_be_served_by_a_variant():
    cfg = copy.deepcopy(TENANTS)
    router_uc(cfg)["routes"]["smollm"]["adapters"] = {"acme-support": {"versions": [
        {"version": 1, "weight": 90}, {"version": 2, "weight": 10}]}}
    assert validate_config(cfg) == [
        f"{ROUTER}.routes.smollm.adapters.acme-support.versions[1]: acme-support@v2 is not "
        "served by any variant of route 'smollm'; add {name: acme-support, version: 2} to a "
        "variant's LLMReplica user_config.adapters"]
    cfg["applications"][1]["deployments"][0]["user_config"]["adapters"].append(
        {"name": "acme-support", "version": 2})
    assert validate_config(cfg) == []


SHADOW = load_yaml(REPO_ROOT / "serve_configs" / "shadow.yaml")


def test_shadow_must_be_a_variant_that_serves_the_route():
    cfg = copy.deepcopy(SHADOW)
    router_uc(cfg)["routes"]["smollm"]["shadow"]["application"] = "nope"
    assert validate_config(cfg) == [
        f"{ROUTER}.routes.smollm.shadow.application: no variant application named 'nope' in "
        "this config; add it (it may serve no traffic: weight 0 or no route) or remove the "
        "shadow"]
    cfg = copy.deepcopy(SHADOW)
    cfg["applications"][2]["args"]["served_model_name"] = "other"
    assert (f"{ROUTER}.routes.smollm.shadow.application: 'smollm-v2' serves 'other', not route "
            "'smollm'; a shadow must answer the same requests: set its "
            "args.served_model_name to 'smollm'") in validate_config(cfg)


def test_one_shadow_per_route_and_none_for_adapter_rollouts():
    cfg = copy.deepcopy(SHADOW)
    route = router_uc(cfg)["routes"]["smollm"]
    route["variants"] = [{"application": "smollm-v1", "weight": 100},
                         {"application": "smollm-v2", "weight": 0}]
    route["rollout"] = {"shadow": {"min_requests": 5}}
    [problem] = validate_config(cfg)
    assert "a route has one shadow at a time" in problem
    del route["shadow"]
    assert validate_config(cfg) == []


MERGED = load_yaml(REPO_ROOT / "serve_configs" / "merged.yaml")
MERGED_AT = "applications[0].deployments[MeshRouter].user_config.routes.smollm.merged.acme-support"


def test_a_merged_variant_must_hold_the_adapter_in_its_weights():
    assert validate_config(MERGED) == []
    cfg = copy.deepcopy(MERGED)
    cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]["merged"] = {
        "globex-report": "smollm-acme"}
    assert validate_config(cfg) == [
        f"{MERGED_AT.replace('acme-support', 'globex-report')}: the model "
        "'smollm2-135m-acme' of 'smollm-acme' has acme-support@v1 merged in, not "
        "'globex-report'; build one with scripts/prepare_model.py --merge-adapter "
        "globex-report@vN --out models/<name>"]
    cfg = copy.deepcopy(MERGED)
    cfg["applications"][2]["args"]["model"] = "smollm2-135m-instruct"
    assert validate_config(cfg) == [
        f"{MERGED_AT}: the model 'smollm2-135m-instruct' of 'smollm-acme' has no adapter "
        "merged in, not 'acme-support'; build one with scripts/prepare_model.py "
        "--merge-adapter acme-support@vN --out models/<name>"]
    cfg["applications"][2]["args"]["served_model_name"] = "other"
    assert validate_config(cfg)[0] == (
        f"{MERGED_AT}: 'smollm-acme' serves 'other'; set its args.served_model_name to "
        "'smollm'")


def test_a_configs_variant_is_found_by_name_or_first_and_a_wrong_name_lists_the_variants():
    from serve_app.common.serve_configs import mesh_parts

    parts = mesh_parts(load_yaml(REPO_ROOT / "serve_configs" / "canary.yaml"))
    names = list(parts.variant_apps)
    assert len(names) >= 2
    assert parts.variant() is parts.variant_apps[names[0]]
    assert parts.variant(names[1])["name"] == names[1]
    with pytest.raises(ValueError) as e:
        parts.variant("nope")
    assert "'nope'" in str(e.value) and all(n in str(e.value) for n in names)


def test_replica_environment_is_the_runtime_env_with_the_threads_ray_gives_the_replica():
    """What the benchmarks' vLLM server and the calibration run their engine with."""
    from serve_app.common.deployment_options import replica_environment
    from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment, mesh_parts

    app = mesh_parts(load_yaml(REPO_ROOT / "serve_configs" / "local.yaml")).variant()
    env = replica_environment(app)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"  # num_cpus 0.5 by default: Ray gives at least 1
    deployment(app, REPLICA_DEPLOYMENT)["ray_actor_options"] = {"num_cpus": 4.5}
    assert replica_environment(app)["OMP_NUM_THREADS"] == "4"  # rounded down, as Ray does
    app["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] = 2
    assert replica_environment(app)["OMP_NUM_THREADS"] == "2"  # the config's own wins


def test_every_shipped_variant_leaves_its_engine_threads_unpinned():
    """vLLM's default binding pins every engine's model to the same core (docs/operating.md):
    two replicas on one host computed on one core."""
    from serve_app.common.serve_configs import mesh_parts

    for path in sorted((REPO_ROOT / "serve_configs").glob("*.yaml")):
        for name, app in mesh_parts(load_yaml(path)).variant_apps.items():
            env = (app.get("runtime_env") or {}).get("env_vars") or {}
            assert env.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind", f"{path.name}: {name}"


# -- token budgets: sized from each route's max_model_len ---------------------------------------

TENANTS = load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml")


def with_initech(**budget):
    cfg = copy.deepcopy(TENANTS)
    initech = next(t for t in router_uc(cfg)["tenants"] if t["id"] == "initech")
    initech.update(budget)
    return cfg


def test_no_shipped_config_has_a_warning():
    for path in sorted((REPO_ROOT / "serve_configs").glob("*.yaml")):
        assert config_warnings(load_yaml(path)) == [], path.name


def test_a_budget_below_one_chat_without_max_tokens_is_a_warning_with_the_figure():
    """At max_model_len 2048 a chat of one empty message without max_tokens reserves its
    prompt bound (56) plus the whole context: 2,104. The shipped initech had 2,000."""
    cfg = with_initech(tokens_per_minute=2000)
    assert validate_config(cfg) == []  # clients that set max_tokens are served
    assert config_warnings(cfg) == [
        f"{ROUTER}.tenants[3].tokens_per_minute: 2000 cannot hold one chat without max_tokens "
        "on route 'smollm' (2104 tokens: its prompt bound, at least 56, plus the route's "
        "max_model_len 2048 ('smollm-v1'), as vLLM may generate the rest of the context), so "
        "tenant 'initech' gets 400 reservation_exceeds_budget for every chat to 'smollm' that "
        "sets no max_tokens; set tokens_per_minute to at least 2104, or have its clients "
        "always set max_tokens (docs/errors.md, \"What a request reserves\")"]
    assert config_warnings(with_initech(tokens_per_minute=2104)) == []


def test_the_smallest_budget_follows_the_routes_max_model_len():
    """The same budget fits a 1024-token route and not a 4096-token one; without
    engine_args.max_model_len, the model's own context (SmolLM2: 8192) is the route's."""
    from serve_app.release.validate import context_length, smallest_request
    from serve_app.common.config import VariantArgs

    def warns(max_model_len):
        cfg = with_initech(tokens_per_minute=None, tokens_per_day=3000)
        args = cfg["applications"][1]["args"]["engine_args"]
        if max_model_len is None:
            del args["max_model_len"]
        else:
            args["max_model_len"] = max_model_len
        return [w for w in config_warnings(cfg) if "tokens_per_day" in w]

    assert warns(1024) == []
    [warning] = warns(4096)
    assert "3000 cannot hold" in warning and "at least 4152" in warning
    [warning] = warns(None)
    assert "max_model_len 8192" in warning and f"at least {56 + 8192}" in warning
    assert smallest_request(8192).total == 56 + 8192
    hub = VariantArgs(model="meta-llama/Llama-3.1-8B-Instruct", revision="0" * 40,
                      served_model_name="llama")
    assert context_length(hub) == 0  # fetched at start: not known here, not checked



def test_a_refused_model_uri_is_not_echoed_where_serve_logs_it():
    """``serve deploy`` without meshctl: the replica's VariantArgs check raises, and Serve
    logs the error's text; pydantic's default text repeats the input, credentials and all."""
    from pydantic import ValidationError

    from serve_app.common.config import ReplicaConfig, VariantArgs

    with pytest.raises(ValidationError) as refusal:
        VariantArgs.model_validate({"model": "s3://AKIAEXAMPLE:wJalrSECRETKEY@my-bucket/llama",
                                    "served_model_name": "llama"})
    with pytest.raises(ValidationError) as registry:
        ReplicaConfig.model_validate({"adapters_manifest": "s3://k:wJalrSECRETKEY@b/m.yaml"})
    for text in (str(refusal.value), str(registry.value)):
        assert "wJalrSECRETKEY" not in text and "a URI carries no credentials" in text, text
