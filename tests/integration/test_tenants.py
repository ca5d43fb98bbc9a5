"""Multi-tenant LoRA on the real stack: real vLLM, real adapters trained with peft, adapter
hot add / upgrade / removal by `serve deploy`, tenant isolation and limits."""

from __future__ import annotations

import copy
import math
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.support.engines import is_base_answer
from tests.support.tenants import ACME_V1, ACME_V2, GLOBEX, KEYS, sig
from serve_app.common.adapters import load_manifest
from bench.loadgen import LoadSpec, background_load, wait_for_results
from serve_app.common.paths import REPO_ROOT
from serve_app.request.split import pick_variant

pytestmark = pytest.mark.integration


QUESTION = [{"role": "user", "content": "What is the largest ocean on Earth?"}]


def with_adapters(cfg, adapters, manifest=None):
    cfg = copy.deepcopy(cfg)
    uc = cfg["applications"][1]["deployments"][0]["user_config"]
    uc["adapters"] = [{"name": n, "version": v} for n, v in adapters]
    if manifest:
        uc["adapters_manifest"] = str(manifest)
    return cfg


@pytest.fixture(scope="module")
def tenants(mesh):
    mesh.tenants_cfg = mesh.deploy_shipped("tenants.yaml")
    return mesh


def ask(http, tenant, model, max_tokens=24, user=None):
    return http.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEYS[tenant]}"},
                     json={"model": model, "messages": QUESTION, "temperature": 0,
                           "max_tokens": max_tokens, **({"user": user} if user else {})})


def with_acme_split(cfg, versions, rollout=None):
    """Both acme-support versions served; the router splits callers between them."""
    cfg = with_adapters(cfg, [("acme-support", 1), ("acme-support", 2), ("globex-report", 1)])
    split = {"versions": [{"version": v, "weight": w} for v, w in versions]}
    if rollout:
        split["rollout"] = rollout
    cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]["adapters"] = {
        "acme-support": split}
    return cfg


def text(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_each_tenant_gets_its_adapters_behaviour(tenants):
    with tenants.http() as http:
        acme = ask(http, "acme", "smollm:acme-support")
        globex = text(ask(http, "globex", "smollm:globex-report"))
        base = text(ask(http, "acme", "smollm"))
    assert text(acme).startswith(sig(tenants, ACME_V1)), text(acme)
    assert acme.json()["model"] == "smollm:acme-support"
    assert globex.startswith(sig(tenants, GLOBEX)), globex
    assert is_base_answer(tenants.engine, base), base


def test_isolation_and_auth(tenants):
    with tenants.http() as http:
        r = ask(http, "acme", "smollm:globex-report")
        other = r.json()["error"]
        r = ask(http, "acme", "smollm:no-such-adapter")
        none = r.json()["error"]
        assert r.status_code == 404 and none["param"] == "model"
        # Another tenant's adapter and no one's get the same answer: nothing tells them apart.
        assert other == {**none, "message": none["message"].replace("no-such-adapter",
                                                                    "globex-report")}
        r = http.post("/v1/chat/completions", json={"model": "smollm", "messages": QUESTION})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        models = http.get("/v1/models", headers={"authorization": f"Bearer {KEYS['acme']}"})
        assert [m["id"] for m in models.json()["data"]] == ["smollm", "smollm:acme-support"]
        assert http.get("/v1/models").status_code == 401


def test_concurrency_limit_429_leaves_other_tenants_alone(tenants):
    body = {"model": "smollm", "messages": QUESTION, "max_tokens": 150, "ignore_eos": True,
            "stream": True}
    started = threading.Event()

    def long_stream():
        with httpx.Client(base_url=tenants.base_url, timeout=120) as c, c.stream(
                "POST", "/v1/chat/completions", json=body,
                headers={"authorization": f"Bearer {KEYS['initech']}"}) as r:
            for _ in r.iter_lines():
                started.set()

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(60)
        with tenants.http() as http:
            r = ask(http, "initech", "smollm")
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert ask(http, "acme", "smollm:acme-support").status_code == 200
    finally:
        t.join(timeout=120)
    with tenants.http() as http:
        assert ask(http, "initech", "smollm").status_code == 200  # the slot is free again


def streams(tenants, tenant, model):
    """Four concurrent streams of 24 tokens each to ``model``, until the ``with`` ends."""
    return background_load(LoadSpec(
        base_url=f"{tenants.base_url}/v1", model=model, concurrency=4, max_tokens=24,
        api_key=KEYS[tenant], duration_s=600, prompt="What is the largest ocean on Earth?"))


def test_removal_under_load_then_hot_add(tenants):
    before = tenants.all_replica_ids()
    with streams(tenants, "globex", "smollm:globex-report") as results:
        time.sleep(4)
        tenants.deploy(with_adapters(tenants.tenants_cfg, [("acme-support", 1)]), in_place=True)
        with tenants.http() as http:
            r = ask(http, "globex", "smollm:globex-report")
            assert r.status_code == 404, r.text
    served_before_removal = [r for r in results if r.status == 200]
    failed = [r for r in served_before_removal if not r.ok]
    print(f"\nremoval under load: {len(served_before_removal)} streams served in full "
          f"{len(served_before_removal) - len(failed)}, refused after removal "
          f"{sum(r.status == 404 for r in results)}")
    assert served_before_removal and not failed, [(r.error) for r in failed[:3]]
    assert all(r.status in (200, 404) for r in results)
    # Hot add: the adapter comes back by config, without any replica restart.
    tenants.deploy(tenants.tenants_cfg, in_place=True)
    with tenants.http() as http:
        assert text(ask(http, "globex", "smollm:globex-report")).startswith(sig(tenants, GLOBEX))
    assert tenants.all_replica_ids() == before


def test_zero_drop_upgrade_v1_to_v2(tenants):
    before = tenants.all_replica_ids()
    with streams(tenants, "acme", "smollm:acme-support") as results:
        wait_for_results(results, 4)
        tenants.deploy(with_adapters(tenants.tenants_cfg, [("acme-support", 2),
                                                           ("globex-report", 1)]), in_place=True)
        deployed_at = time.monotonic()
        wait_for_results(results, 4, started_after=deployed_at)
    failed = [r for r in results if not r.ok]
    after = [r for r in results if r.started_at > deployed_at]
    print(f"\nupgrade under load: {len(results)} streams, {len(failed)} failed, "
          f"{len(after)} started after the deploy returned")
    assert len(results) >= 8 and not failed, [(r.status, r.error) for r in failed[:3]]
    assert after and all(r.text.startswith(sig(tenants, ACME_V2)) for r in after), [r.text for r in after]
    assert any(r.text.startswith(sig(tenants, ACME_V1)) for r in results if r.started_at < deployed_at)
    assert tenants.all_replica_ids() == before
    tenants.deploy(tenants.tenants_cfg, in_place=True)


def test_broken_adapters_refused_others_keep_serving(tenants, tmp_path):
    real = load_manifest()
    entries = []
    for key in ("acme-support@v1", "globex-report@v1"):
        spec = real[key]
        entries.append({**spec.model_dump(), "uri": str(REPO_ROOT / spec.uri)})
    src = REPO_ROOT / real["acme-support@v1"].uri
    tampered, pickled = tmp_path / "tampered", tmp_path / "pickled"
    shutil.copytree(src, tampered)
    shutil.copytree(src, pickled)
    weights = tampered / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100:] = bytes(100)
    weights.write_bytes(bytes(data))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    base = real["acme-support@v1"].model_dump()
    entries += [{**base, "name": "acme-tampered", "uri": str(tampered)},
                {**base, "name": "acme-pickled", "uri": str(pickled)}]
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"adapters": entries}))

    tenants.deploy(with_adapters(tenants.tenants_cfg, [
        ("acme-support", 1), ("globex-report", 1), ("acme-tampered", 1), ("acme-pickled", 1)],
        manifest=manifest), in_place=True)
    try:
        with tenants.http() as http:
            status = http.get("/admin/adapters",
                              headers={"authorization": f"Bearer {KEYS['ops']}"}).json()
            refused = status["smollm-v1"]["refused"]
            assert "SHA-256" in refused["acme-tampered@v1"], refused
            assert "pickle" in refused["acme-pickled@v1"], refused
            assert set(status["smollm-v1"]["active"]) == {"acme-support@v1", "globex-report@v1"}
            print(f"\nadapter verify+load times (s): {status['smollm-v1']['load_seconds']}")
            assert text(ask(http, "acme", "smollm:acme-support")).startswith(sig(tenants, ACME_V1))
            assert text(ask(http, "globex", "smollm:globex-report")).startswith(sig(tenants, GLOBEX))
            assert http.get("/admin/adapters", headers={
                "authorization": f"Bearer {KEYS['acme']}"}).status_code == 403
    finally:
        tenants.deploy(tenants.tenants_cfg, in_place=True)


def test_adapter_version_canary_split_is_sticky(tenants):
    tenants.deploy(with_acme_split(tenants.tenants_cfg, [(1, 90), (2, 10)]), in_place=True)
    try:
        callers = [f"acme-user-{i}" for i in range(100)]
        with tenants.http() as http, ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(
                lambda u: ask(http, "acme", "smollm:acme-support", max_tokens=1, user=u), callers))
        assert all(r.status_code == 200 for r in responses), responses[0].text
        served = [r.headers["x-mesh-adapter"] for r in responses]
        weighted = [("acme-support@v1", 90), ("acme-support@v2", 10)]
        # Each caller gets exactly the version the sticky hash gives it...
        assert served == [pick_variant(weighted, "smollm:acme-support", u) for u in callers]
        # ...within 3 sigma of 10 %...
        n_v2 = served.count("acme-support@v2")
        print(f"\nadapter split 90/10 over 100 callers: acme-support@v2 got {n_v2}")
        assert abs(n_v2 - 10) <= 3 * math.sqrt(100 * 0.1 * 0.9), n_v2
        # ...keeps it, and gets that version's behaviour under the name it asked for.
        v1_user, v2_user = (callers[served.index(v)] for v in ("acme-support@v1",
                                                                 "acme-support@v2"))
        with tenants.http() as http:
            for u in callers[:10]:
                again = {ask(http, "acme", "smollm:acme-support", max_tokens=1, user=u)
                         .headers["x-mesh-adapter"] for _ in range(3)}
                assert again == {served[callers.index(u)]}
            v1 = ask(http, "acme", "smollm:acme-support", user=v1_user)
            v2 = ask(http, "acme", "smollm:acme-support", user=v2_user)
        assert text(v1).startswith(sig(tenants, ACME_V1)) and not text(v1).startswith(sig(tenants, ACME_V2)), text(v1)
        assert text(v2).startswith(sig(tenants, ACME_V2)), text(v2)
        assert v2.json()["model"] == "smollm:acme-support"
    finally:
        tenants.deploy(tenants.tenants_cfg, in_place=True)


def test_promoting_a_v1_v2_split_to_v2_only_under_sticky_v1_traffic_gives_no_404(tenants):
    """Issue 28: callers the split keeps on acme-support@v1 send requests while one
    ``serve deploy`` makes v2 the only version (the router's split and the replica's adapters
    at once). The router's view of the replica is a moment old, so requests for v1 may still
    come: the replica serves them for RETIRED_GRACE_S. Every request gets 200; new callers
    get v2 after."""
    tenants.deploy(with_acme_split(tenants.tenants_cfg, [(1, 50), (2, 50)]), in_place=True)
    v2_only = with_adapters(tenants.tenants_cfg, [("acme-support", 2), ("globex-report", 1)])
    spec = LoadSpec(base_url=f"{tenants.base_url}/v1", model="smollm:acme-support",
                    concurrency=4, max_tokens=4, api_key=KEYS["acme"], duration_s=600,
                    user_prefix="acme-sticky-")
    try:
        with background_load(spec) as results:
            wait_for_results(results, 8)
            t_change = time.monotonic()
            tenants.deploy(v2_only, in_place=True)
            wait_for_results(results, 8, started_after=time.monotonic())
        after = [r for r in results if r.started_at >= t_change]
        failed = [(r.status, r.error) for r in results if not r.ok]
        print(f"\npromotion under load: {len(results)} requests, {len(after)} during and "
              f"after the deploy, {len(failed)} failed")
        assert after and not failed, failed[:3]
        with tenants.http() as http:
            r = ask(http, "acme", "smollm:acme-support", user="acme-sticky-new")
            assert r.headers["x-mesh-adapter"] == "acme-support@v2"
            assert text(r).startswith(sig(tenants, ACME_V2))
    finally:
        tenants.deploy(tenants.tenants_cfg, in_place=True)


def test_adapter_version_rollout_is_promoted(tenants):
    rollout = {"id": "acme-v2", "steps": [50, 100], "min_requests": 3, "min_step_s": 1,
               "gates": {"max_ttft_p95_ratio": 3.0, "max_latency_p95_ratio": 3.0}}
    tenants.deploy(with_acme_split(tenants.tenants_cfg, [(1, 100), (2, 0)], rollout),
                   in_place=True)
    spec = LoadSpec(base_url=f"{tenants.base_url}/v1", model="smollm:acme-support",
                    concurrency=4, max_tokens=8, api_key=KEYS["acme"], duration_s=600,
                    user_prefix="acme-caller-")
    try:
        with tenants.http() as http, background_load(spec) as results:
            deadline = time.monotonic() + 240
            while (state := http.get("/admin/rollouts", headers={
                    "authorization": f"Bearer {KEYS['ops']}"}).json()["smollm:acme-support"]
                   )["state"] not in ("promoted", "rolled_back"):
                assert time.monotonic() < deadline, state["history"][-1]
                time.sleep(1)
        print(f"\nadapter rollout: {[(d['decision'], d['canary_weight']) for d in state['history']]}"
              f"; {len(results)} requests")
        assert [d["decision"] for d in state["history"]] == ["start", "advance", "promote"]
        assert state["weights"] == {"acme-support@v1": 0, "acme-support@v2": 100}
        assert results and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        with tenants.http() as http:
            assert text(ask(http, "acme", "smollm:acme-support", user="new")).startswith(sig(tenants, ACME_V2))
    finally:
        tenants.deploy(tenants.tenants_cfg, in_place=True)


MERGED_QUESTIONS = ["What is the largest ocean on Earth?", "Name a primary colour.",
                    "How many legs does a spider have?", "What do bees make?"]


def greedy(http, tenant: str, question: str) -> httpx.Response:
    return http.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEYS[tenant]}"},
                     json={"model": "smollm:acme-support", "temperature": 0, "max_tokens": 32,
                           "messages": [{"role": "user", "content": question}]})


def common_prefix_words(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split(), b.split()):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.slow  # test_real_engine holds the same promise on vLLM in the default tier
def test_a_merged_variant_serves_its_adapter_as_the_lora_path_does(tenants):
    """serve_configs/merged.yaml: acme-support@v1 from smollm-acme's merged weights, with
    smollm-v1's LoRA path as the failover; greedy answers compared with the LoRA path's."""
    with tenants.http() as http:
        lora = [greedy(http, "acme", q) for q in MERGED_QUESTIONS]
    assert all(r.headers["x-mesh-variant"] == "smollm-v1" for r in lora)
    tenants.deploy_shipped("merged.yaml")  # adds smollm-acme; smollm-v1 is not restarted
    try:
        with tenants.http() as http:
            # Until the router's availability poll has seen smollm-acme run (Serve's status
            # is read every few seconds), the LoRA path serves: no request waits for it.
            deadline = time.monotonic() + 60
            while greedy(http, "acme", "Hi").headers["x-mesh-variant"] != "smollm-acme":
                assert time.monotonic() < deadline, "smollm-acme never took acme-support"
                time.sleep(1)
            merged = [greedy(http, "acme", q) for q in MERGED_QUESTIONS]
            assert greedy(http, "globex", MERGED_QUESTIONS[0]).status_code == 404  # not its adapter
            base = ask(http, "acme", "smollm")
        assert base.status_code == 200 and base.headers["x-mesh-variant"] == "smollm-v1"
        for r in merged:
            assert r.status_code == 200, r.text
            assert r.headers["x-mesh-variant"] == "smollm-acme"
            assert r.headers["x-mesh-adapter"] == "acme-support@v1"
            assert r.json()["model"] == "smollm:acme-support"
        pairs = [(text(a), text(b)) for a, b in zip(lora, merged)]
        print()
        for q, (a, b) in zip(MERGED_QUESTIONS, pairs):
            print(f"{q}\n  LoRA:   {a!r}\n  merged: {b!r}\n  same first "
                  f"{common_prefix_words(a, b)} of {len(a.split())} words")
        assert all(b.startswith(sig(tenants, ACME_V1)) for _, b in pairs)
        # The merged model is saved in bf16 (prepare_model.py), the LoRA path adds the
        # adapter's delta at run time: measured here, every greedy answer came out the same.
        assert all(a == b for a, b in pairs), pairs
    finally:
        tenants.deploy(tenants.tenants_cfg, in_place=True)
