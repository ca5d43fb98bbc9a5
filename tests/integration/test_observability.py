"""Observability on the real stack, with a real Prometheus: every dashboard panel's query
returns data from a mesh under load and a rollout; engine series carry the variant; request
ids reach vLLM and the access log; client-made names never become label values; the rollout
report is written from the admin API and Prometheus.

The mesh: serve_configs/canary.yaml with both variants serving acme-support, tenants that
own it or are limited, and a quick rollout of smollm-v2.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.observability import prometheus
from bench import local_prometheus
from bench.loadgen import LoadSpec, background_load
from bench.servers import free_port
from tests.support.dashboard import dashboard
from tests.support.waits import settled

pytestmark = pytest.mark.integration

OPS, ACME, INITECH = "sk-mesh-ops-demo", "sk-acme-demo", "sk-initech-demo"
TENANTS = [
    {"id": "ops", "admin": True, "api_keys_sha256": [
        "f2c14c156be11e6f4c5e602ef6f7bda53877e8f5c0b22fa44753765bc318a1b1"]},
    {"id": "acme", "adapters": ["acme-support"], "api_keys_sha256": [
        "953d0ab8229abd463060e52204c8cb44e32297002500258c1181e18379c54626"]},
    {"id": "initech", "max_concurrent_requests": 1, "tokens_per_minute": 100_000,
     "api_keys_sha256": [
        "02dc44b9a095b685642f28c22d7a820047ce4afb3da04d6803da3388d9ecdc17"]},
]


AFFINITY_ROUTER = load_yaml(REPO_ROOT / "serve_configs" / "affinity.yaml")["applications"][1][
    "deployments"][0]["request_router_config"]


def dashboard_queries() -> list[tuple[str, str]]:
    """Every panel's queries but the scale-to-zero row's (test_scale_to_zero.py has the cold
    starts behind them)."""
    build = dashboard()
    return build.queries(but={build.SCALE_TO_ZERO_ROW})


def observed_config(base, routed_before: bool):
    """canary.yaml with the module's tenants, adapters and rollout. ``routed_before``: the
    router's handle to smollm-v1 was made by test_replica_routing, through the affinity
    router, and keeps it whatever smollm-v1's config says (Serve makes a handle's request
    router once): the replica-routing panel has data without a replica restart."""
    cfg = copy.deepcopy(base)
    router = cfg["applications"][0]["deployments"][0]["user_config"]
    router["tenants"] = TENANTS
    router["routes"]["smollm"]["variants"] = [{"application": "smollm-v1", "weight": 100},
                                              {"application": "smollm-v2", "weight": 0}]
    router["routes"]["smollm"]["rollout"] = {
        "id": "observed", "steps": [50, 100], "min_requests": 3, "min_step_s": 5,
        "gates": {"max_ttft_p95_ratio": None, "max_latency_p95_ratio": None}}
    for app in cfg["applications"][1:]:
        app["deployments"][0]["user_config"]["adapters"] = [{"name": "acme-support",
                                                             "version": 1}]
    if not routed_before:  # alone: smollm-v1 through the affinity router (one replica: its
        # decisions are "single"), as in the whole suite (a restart: a code version change)
        cfg["applications"][1]["deployments"][0]["request_router_config"] = copy.deepcopy(
            AFFINITY_ROUTER)
    return cfg


@pytest.fixture(scope="module")
def observed(mesh):
    base = mesh.config("canary.yaml")
    mesh.deploy(observed_config(base, routed_before=hasattr(mesh, "affinity_cfg")))
    proc, url = local_prometheus.start(free_port())  # 5 s, as shipped
    mesh.prometheus = url
    yield mesh
    proc.terminate()
    proc.wait(timeout=30)
    # Not redeployed: the next module deploys its own config, and restoring smollm-v2's
    # max_model_len (the last test changes it) would restart its engine for nothing.


def wait_for(what: str, check, timeout_s: float = 120, every_s: float = 2):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
    return result


def test_every_dashboard_panel_returns_data_and_a_rollout_report_is_written(observed,
                                                                            tmp_path):
    queries = dashboard_queries()
    assert len(queries) >= 20
    spec = LoadSpec(base_url=f"{observed.base_url}/v1", model="smollm", concurrency=3,
                    max_tokens=16, duration_s=900, user_prefix="caller-",
                    mix=(("smollm", OPS), ("smollm:acme-support", ACME)))
    with observed.http() as http, background_load(spec) as results:
        # Tenant rejections: 401 (a wrong key), 404 (another tenant's adapter: the answer a
        # name no one owns gets), 429 (initech sends two at once, its limit is one).
        body = {"model": "smollm", "max_tokens": 24, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count to ten."}]}
        assert http.post("/v1/chat/completions", json=body,
                         headers={"authorization": "Bearer sk-wrong"}).status_code == 401
        assert http.post("/v1/chat/completions", json={**body, "model": "smollm:acme-support"},
                         headers={"authorization": f"Bearer {INITECH}"}).status_code == 404
        with ThreadPoolExecutor(3) as pool:
            statuses = sorted(pool.map(lambda _: observed.http().post(
                "/v1/chat/completions", json=body,
                headers={"authorization": f"Bearer {INITECH}"}).status_code, range(3)))
        assert 429 in statuses and 200 in statuses, statuses
        state = wait_for("the rollout to be promoted", lambda: (s := http.get(
            "/admin/rollouts", headers={"authorization": f"Bearer {OPS}"}).json()["smollm"])[
            "state"] == "promoted" and s, timeout_s=240)
        print(f"\nrollout: {[d['decision'] for d in state['history']]}")

        # Every panel's query, through Prometheus's HTTP API, while the load goes on.
        missing = local_prometheus.without_data(observed.prometheus, queries, 180)
        assert not missing, (f"panels without data: {missing}; failing scrapes: "
                             f"{local_prometheus.target_errors(observed.prometheus)}")
        # Engine series carry the variant (a scrape between two exports may miss one: wait)
        wait_for("engine series of both variants", lambda: {
            r["metric"].get("variant") for r in prometheus.query(
                observed.prometheus, "sum by (variant) (ray_vllm_num_requests_running)")}
            == {"smollm-v1", "smollm-v2"}, timeout_s=60)

        # The rollout report, from the admin API and Prometheus.
        out = subprocess.run([sys.executable, "-m", "serve_app.cli", "rollout-report",
                              "--out", str(tmp_path), "--router-url", observed.base_url,
                              "--admin-key", OPS, "--prometheus", observed.prometheus],
                             capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "rollout-smollm.md").read_text()
    print(report)
    assert report.startswith("# Rollout `observed` of `smollm`: promoted")
    assert "| promote | 100 % |" in report
    png = tmp_path / "rollout-smollm.png"
    assert png.stat().st_size > 30_000
    keep = REPO_ROOT / ".mesh" / "rollout-report"  # left for people to look at
    keep.mkdir(parents=True, exist_ok=True)
    (keep / png.name).write_bytes(png.read_bytes())
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]


def test_request_ids_reach_vllm_and_the_access_log(observed):
    with observed.http() as http:
        r = http.post("/v1/chat/completions", headers={
            "authorization": f"Bearer {OPS}", "x-request-id": "bug-report-4711"}, json={
            "model": "smollm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "bug-report-4711"
        assert r.json()["id"] == "chatcmpl-bug-report-4711"  # vLLM's own request id
        # Without one, Serve's proxy makes one; errors carry theirs too.
        r = http.post("/v1/chat/completions", headers={"authorization": f"Bearer {OPS}"}, json={
            "model": "smollm", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["id"] == f"chatcmpl-{r.headers['x-request-id']}"
        bad = http.post("/v1/chat/completions", json={"model": "nope"},
                        headers={"authorization": f"Bearer {OPS}"})
        assert bad.status_code == 404 and bad.headers["x-request-id"]
    logs = list(observed.serve_logs.glob("replica_mesh_MeshRouter_*.log"))

    def logged() -> list[str]:
        return [line for f in logs for line in open(f) if '"bug-report-4711"' in line]
    line = wait_for("the access log line", logged, timeout_s=30, every_s=1)[0]
    assert ' access {"request_id": "bug-report-4711", "tenant": "ops", "route": "smollm", ' in line
    assert '"status": 200' in line and '"completion_tokens": 4' in line


def test_client_made_names_never_become_label_values(observed):
    """20 requests naming made-up adapters (404 each) add no adapter label value."""
    def adapter_labels() -> set[str]:
        text = observed.metrics_text()
        return {line.split('adapter="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("ray_mesh_requests_total{") and 'adapter="' in line}

    before = settled(adapter_labels)  # the series of the requests so far are exported
    with observed.http() as http:
        for i in range(20):
            r = http.post("/v1/chat/completions", json={
                "model": f"smollm:junk-{i}", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": f"Bearer {ACME}"})
            assert r.status_code == 404
            r = http.post("/v1/chat/completions", json={
                "model": f"made-up-{i}", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": f"Bearer {ACME}"})
            assert r.status_code == 404
    labels = wait_for("the unknown label", lambda: (a := adapter_labels()) and
                      "unknown" in a and a, timeout_s=60)
    print(f"\nadapter label values before: {sorted(before)}, after: {sorted(labels)}")
    assert labels <= before | {"unknown"}
    text = observed.metrics_text()
    assert "junk" not in text and "made-up" not in text
