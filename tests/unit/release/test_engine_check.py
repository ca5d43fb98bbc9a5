"""``meshctl validate``'s engine-arg checks wherever the model is
(:mod:`serve_app.release.engine_check`): offline, the values that need no model, and a
warning that names what was skipped; online, the model's config.json from the hub at the
pinned commit or from the bucket, and vLLM's checks against it (attention heads divisible by
``tensor_parallel_size``, ``max_model_len`` within the model's). The hub and the bucket are
real protocols on 127.0.0.1 (tests/support: a small hub, moto's S3)."""

from __future__ import annotations

import copy

import pytest

from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.release.engine_check import MODEL_CHECKS, PLATFORM_CHECKS, engine_problems
from serve_app.release.validate import validate_config
from tests.support.hub_server import HubServer
from tests.support.model_configs import LLAMA_8B, LLAMA_8B_COMMIT, write_llama_8b
from tests.support.s3_server import S3Server

FLEET = REPO_ROOT / "tests/support/configs/first_day_fleet.yaml"
V1, V2 = "applications[1].args", "applications[2].args"
HEADS_3 = (f"{V2}.engine_args.tensor_parallel_size: vLLM refuses 3: Total number of attention "
           "heads (32) must be divisible by tensor parallel size (3).")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return write_llama_8b(tmp_path_factory.mktemp("llama") / "Llama-3.1-8B-Instruct")


@pytest.fixture(scope="module")
def hub(llama_folder):
    server = HubServer({LLAMA_8B: (LLAMA_8B_COMMIT, llama_folder)}).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3(llama_folder):
    server = S3Server()
    server.start()
    server.upload(llama_folder, "models", "Llama-3.1-8B-Instruct")
    yield server
    server.stop()


@pytest.fixture
def online(tmp_path, monkeypatch, hub, s3):
    """A host with network: the hub and the bucket on 127.0.0.1, empty caches."""
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return hub


def fleet(**v2_engine_args) -> dict:
    cfg = copy.deepcopy(load_yaml(FLEET))
    for app in cfg["applications"]:  # the registry, from wherever the test runs
        for dep in app.get("deployments") or []:
            uc = dep.get("user_config") or {}
            if "adapters_manifest" in uc:
                uc["adapters_manifest"] = str(REPO_ROOT / uc["adapters_manifest"])
    cfg["applications"][2]["args"]["engine_args"].update(v2_engine_args)
    return cfg


def test_offline_tp_3_is_not_refused_and_the_warning_says_what_was_skipped(online):
    cfg = fleet(tensor_parallel_size=3)
    assert validate_config(cfg) == []  # three GPU bundles: the mesh's checks pass
    problems, warnings = engine_problems(cfg, offline=True)
    assert problems == []
    assert warnings[1] == (
        f"{V2}.engine_args: checked the names and values (types, ranges, choices); not "
        f"checked: against the model's config.json, not read here (offline: --offline): "
        f"{MODEL_CHECKS}; {PLATFORM_CHECKS}: this host's vLLM is the CPU build, the variant "
        "runs on GPUs; run meshctl validate where the GPU lock is installed (MESH_ACCEL=gpu "
        "./scripts/setup.sh). The replica checks them when it starts")
    assert online.requests == {}  # nothing was read from the hub


def test_hf_hub_offline_keeps_validate_offline(online, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems, warnings = engine_problems(fleet(tensor_parallel_size=3))
    assert problems == [] and "not read here (offline: HF_HUB_OFFLINE is set)" in warnings[1]
    assert online.requests == {}


def test_online_tp_3_on_32_heads_is_refused_from_the_hubs_config_json(online):
    problems, warnings = engine_problems(fleet(tensor_parallel_size=3), offline=False)
    assert problems == [HEADS_3]
    # config.json and the generation config, once for both variants; never the weights
    assert online.requests == {f"{LLAMA_8B}/config.json": 1,
                               f"{LLAMA_8B}/generation_config.json": 1}


def test_online_the_tried_config_passes_and_says_what_only_the_gpu_build_checks(online):
    problems, warnings = engine_problems(fleet(), offline=False)
    assert problems == []
    assert warnings == [
        f"{at}.engine_args: checked the names and values (types, ranges, choices), and "
        f"against the model's config.json; not checked: {PLATFORM_CHECKS}: this host's vLLM "
        "is the CPU build, the variant runs on GPUs; run meshctl validate where the GPU lock "
        "is installed (MESH_ACCEL=gpu ./scripts/setup.sh). The replica checks them when it "
        "starts" for at in (V1, V2)]


def test_online_a_max_model_len_past_the_models_is_refused(online):
    problems, _ = engine_problems(fleet(max_model_len=200_000), offline=False)
    assert len(problems) == 1 and problems[0].startswith(
        f"{V2}.engine_args.max_model_len: vLLM refuses 200000: User-specified max_model_len "
        "(200000) is greater than the derived max_model_len (max_position_embeddings=131072")


def test_online_a_commit_the_hub_does_not_have_is_refused(online):
    cfg = fleet()
    for app in cfg["applications"][1:]:
        app["args"]["revision"] = "1" * 40
    problems, _ = engine_problems(cfg, offline=False)
    assert problems == [f"{at}.revision: the hub has no commit {'1' * 40} of {LLAMA_8B}: copy "
                        f"the full hash of an existing one (HfApi().model_info('{LLAMA_8B}')"
                        ".sha gives today's)" for at in (V1, V2)]


def test_online_from_a_bucket(online):
    cfg = fleet(tensor_parallel_size=3)
    for app in cfg["applications"][1:]:
        app["args"].update(model="s3://models/Llama-3.1-8B-Instruct", revision=None)
    problems, warnings = engine_problems(cfg, offline=False)
    assert problems == [HEADS_3], warnings
    for app in cfg["applications"][1:]:
        app["args"]["model"] = "s3://models/no-such-model"
    problems, _ = engine_problems(cfg, offline=False)
    assert problems == [f"{at}.model: s3://models/no-such-model/config.json does not exist: "
                        "upload the model's folder there (config.json, the weights, the "
                        "tokenizer files), or fix the URI" for at in (V1, V2)]


def test_a_hub_that_does_not_answer_is_a_warning_not_a_refusal(online, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    problems, warnings = engine_problems(fleet(tensor_parallel_size=3), offline=False)
    assert problems == []
    assert ("not read here (reading it failed: 127.0.0.1:9 does not answer (Connection "
            "refused))") in warnings[1]


def test_a_cached_copy_is_checked_in_place(online, tmp_path, monkeypatch):
    """A model fetched on this host before: its config.json is read where it is."""
    from serve_app.common.fetch import fetch_model

    fetch_model(LLAMA_8B, LLAMA_8B_COMMIT)  # config files only on this hub: no weights
    online.requests.clear()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    problems, _ = engine_problems(fleet(tensor_parallel_size=3), offline=True)
    assert problems == [HEADS_3] and online.requests == {}
