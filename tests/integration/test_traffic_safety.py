"""A client's bad request never looks like a variant failure, and a variant failure always
does: the request catalog through a mesh under a rollout (no 5xx, no failover, no error
observation), a tenant sending only bad requests cannot roll back a healthy canary, and a
canary whose vLLM engine dies mid-stream is counted against its arm while its callers fail
over (serve_configs/canary.yaml: smollm-v1 stable, smollm-v2 canary)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest

from bench.loadgen import LoadSpec, background_load
from serve_app.request.split import pick_variant
from tests.support.metrics import metric_total
from tests.support.replicas import stream_and_kill
from tests.support.request_catalog import CASES
from tests.support.rollouts import SLOW, rollout_state, with_rollout
from tests.support.waits import wait_for_metric

pytestmark = pytest.mark.integration

OPS = {"authorization": "Bearer sk-mesh-ops-demo"}  # admin tenant of canary.yaml


@pytest.fixture(scope="module")
def safety(mesh):
    mesh.base_cfg = mesh.deploy_shipped("canary.yaml")
    return mesh


def test_request_catalog_gets_4xx_or_answers_and_never_a_variant_failure(safety):
    """Every catalog case, sent by callers on both arms of a running rollout: no status >=
    500, every error an OpenAI error body, no failover, no error observation for either arm."""
    safety.deploy(with_rollout(safety.base_cfg, {"id": "catalog", **SLOW}), in_place=True)
    assert len(CASES) >= 40
    before_failovers = metric_total(safety, "ray_mesh_failovers_total")
    before_requests = metric_total(safety, "ray_mesh_requests_total")
    statuses = {}
    with safety.http() as http:
        for i, case in enumerate(CASES):
            headers = {**OPS, "content-type": "application/json", "x-session-id": f"c{i}"}
            r = http.post(case.path, content=case.content(), headers=headers)
            statuses[case.name] = r.status_code
            assert r.status_code < 500, (case.name, r.status_code, r.text[:500])
            if case.expect == "4xx":
                assert 400 <= r.status_code < 500, (case.name, r.status_code, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, (case.name, err)
                assert err["message"] and err["type"], (case.name, err)
            elif "stream" in case.name:
                assert r.text.rstrip().endswith("data: [DONE]"), (case.name, r.text[-300:])
        arms = {r.headers.get("x-mesh-variant") for r in [
            http.post("/v1/chat/completions", headers={**OPS, "x-session-id": f"c{i}"},
                      json={"model": "smollm", "max_tokens": 1,
                            "messages": [{"role": "user", "content": "hi"}]})
            for i in range(len(CASES))]}
        assert arms == {"smollm-v1", "smollm-v2"}, "the catalog did not reach both arms"
        time.sleep(1.5)  # the routers report observations every 0.5 s
        step = rollout_state(http)["current_step"]
    print(f"\n{len(CASES)} catalog cases: " + ", ".join(
        f"{s}x{n}" for s, n in sorted(_count(statuses.values()).items())))
    print(f"rollout figures after the catalog: canary {step['canary']}, stable {step['stable']}")
    assert step["canary"]["errors"] == 0 and step["stable"]["errors"] == 0
    assert step["canary"]["requests"] > 0 and step["stable"]["requests"] > 0
    # once the catalog's requests are exported, so is any failover they made (one export)
    wait_for_metric(safety, "ray_mesh_requests_total", before_requests + len(CASES))
    assert metric_total(safety, "ray_mesh_failovers_total") == before_failovers


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def test_a_tenant_sending_only_bad_requests_cannot_roll_back_a_healthy_canary(safety):
    """Good traffic flows while another caller sends only catalog requests that fail (each
    to whichever arm its session lands on): the rollout still promotes the canary."""
    safety.deploy(with_rollout(safety.base_cfg, {"id": "bad-tenant", "steps": [50, 100]}),
                  in_place=True)
    bad = [c for c in CASES if c.expect == "4xx"]
    stop = threading.Event()
    bad_statuses: list[int] = []

    def send_bad() -> None:
        with safety.http() as http:
            for i in itertools.count():
                if stop.is_set():
                    return
                case = bad[i % len(bad)]
                r = http.post(case.path, content=case.content(), headers={
                    **OPS, "content-type": "application/json", "x-session-id": f"bad-{i}"})
                bad_statuses.append(r.status_code)

    spec = LoadSpec(base_url=f"{safety.base_url}/v1", model="smollm", concurrency=3,
                    max_tokens=8, api_key="sk-mesh-ops-demo", duration_s=600,
                    user_prefix="good-")
    sender = threading.Thread(target=send_bad)
    with safety.http() as http, background_load(spec) as results:
        sender.start()
        deadline = time.monotonic() + 240
        while (state := rollout_state(http))["state"] not in ("promoted", "rolled_back"):
            assert time.monotonic() < deadline, state["history"][-1]
            time.sleep(1)
        stop.set()
    sender.join()
    print(f"\nbad caller sent {len(bad_statuses)} requests: "
          f"{sorted(_count(bad_statuses).items())}; good load {len(results)} requests")
    for d in state["history"]:
        print(f"  {d['decision']:>8} -> {d['canary_weight']:>3}%  canary {d['canary']}  "
              f"({d['reason']})")
    assert state["state"] == "promoted", state["history"][-1]["reason"]
    assert len(bad_statuses) >= 20 and all(400 <= s < 500 for s in bad_statuses)
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert all(d["canary"]["errors"] == 0 for d in state["history"])


def test_engine_death_mid_stream_counts_against_the_arm_and_callers_fail_over(safety):
    """Kill the canary's engine (``LLMReplica.kill_engine``: vLLM's EngineCore process gets
    SIGKILL, a simulated core dies) while it streams to a caller of the canary arm: the stream ends with vLLM's in-band error event, the router counts a failed
    (truncated) stream against the canary, the caller's next requests fail over to the
    stable variant, a pinned request gets 503 + Retry-After, and Serve replaces the replica."""
    from ray import serve

    safety.deploy(with_rollout(safety.base_cfg, {"id": "engine-death", **SLOW}))
    weights = [("smollm-v1", 50), ("smollm-v2", 50)]
    caller = next(f"crash-{i}" for i in itertools.count()
                  if pick_variant(weights, "smollm", f"crash-{i}") == "smollm-v2")
    replica = serve.get_deployment_handle("LLMReplica", app_name="smollm-v2")
    before_ids = safety.replica_ids("smollm-v2", "LLMReplica")
    failed_streams = metric_total(safety, "ray_mesh_errors_total", variant="smollm-v2",
                                  kind="stream_failed")
    body = {"model": "smollm", "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=safety.base_url, timeout=120) as http:
        lines, t_kill = stream_and_kill(http, body, {**OPS, "x-session-id": caller},
                                        "smollm-v2",
                                        lambda: replica.kill_engine.remote().result())
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: "):])["error"]
        print(f"\nstream ended after {len(lines)} events with: {error}")
        assert "EngineCore" in error["message"]

        # The caller's next requests fail over to the stable variant at once.
        r = http.post("/v1/chat/completions", headers={**OPS, "x-session-id": caller}, json={
            "model": "smollm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.headers["x-mesh-variant"] == "smollm-v1", r.text
        # A request pinned to the dead variant gets 503 with Retry-After, not a hang.
        pinned = http.post("/v1/chat/completions", headers={**OPS, "x-mesh-variant":
                                                            "smollm-v2"}, json={
            "model": "smollm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert pinned.status_code == 503 and pinned.headers["retry-after"], pinned.text
        time.sleep(1.5)
        step = rollout_state(http)["current_step"]["canary"]
        print(f"canary figures: {step}")
        assert step["truncated"] >= 1 and step["errors"] >= 2  # the stream, the failover

        # Serve replaces the replica; measure until the canary answers again.
        statuses = []
        while True:
            r = http.post("/v1/chat/completions", headers={**OPS, "x-mesh-variant":
                                                           "smollm-v2"}, json={
                "model": "smollm", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.headers.get("retry-after"), r.text
            assert time.monotonic() - t_kill < 240, "the replica was not replaced"
            time.sleep(1)
        recovery_s = time.monotonic() - t_kill
    print(f"canary serving again {recovery_s:.0f} s after its engine was killed; requests "
          f"pinned to it meanwhile: {sorted(_count(statuses).items())}")
    assert safety.replica_ids("smollm-v2", "LLMReplica").isdisjoint(before_ids)
    wait_for_metric(safety, "ray_mesh_errors_total", failed_streams + 1, variant="smollm-v2",
                    kind="stream_failed")
