"""Cache-aware replica routing on the real stack: serve_configs/affinity.yaml (smollm-v1 with
two replicas, two vLLM engines, and the mesh's AffinityRouter) through the real router, with
the placement read from each response's x-mesh-replica header.

First of the integration modules: Serve reads a deployment's request router when a handle to
it is first made, so the router's handle to smollm-v1 must be made with this config. The
modules after it run one replica, where the router passes every request through.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_app.common.wire import REPLICA_HEADER

pytestmark = pytest.mark.integration

SUPPORT = "You are the support assistant of ACME Corp. Answer in one short sentence. " * 8
BILLING = "You are the billing desk of Globex Inc. Reply with a number when you can. " * 8


@pytest.fixture(scope="module")
def routed(mesh):
    mesh.affinity_cfg = mesh.deploy_shipped("affinity.yaml")
    mesh.replicas = mesh.replica_ids("smollm-v1", "LLMReplica")
    assert len(mesh.replicas) == 2, mesh.replicas
    return mesh


def ask(http: httpx.Client, messages: list[dict], session: str | None = None,
        max_tokens: int = 4) -> str:
    """One chat request; the replica that served it."""
    r = http.post("/v1/chat/completions", headers={"x-session-id": session} if session else {},
                  json={"model": "smollm", "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER]


def turn(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_two_system_prompts_land_on_different_replicas_and_stay(routed):
    with routed.http() as http:
        support = {ask(http, turn(SUPPORT, f"Where is order {i}?")) for i in range(4)}
        billing = {ask(http, turn(BILLING, f"What do I owe for invoice {i}?")) for i in range(4)}
    assert len(support) == 1 and len(billing) == 1, (support, billing)
    assert support | billing == routed.replicas  # one replica each: two caches, no copies


def test_a_conversation_stays_on_its_replica_turn_after_turn(routed):
    with routed.http() as http:
        served: dict[str, list[str]] = {f"s{i}": [] for i in range(4)}
        history = {s: [{"role": "user", "content": f"Hello, I am caller {s}."}]
                   for s in served}
        for _ in range(3):  # turns of the four conversations, interleaved
            for s in served:
                served[s].append(ask(http, history[s], session=s))
                history[s] += [{"role": "assistant", "content": "Hello!"},
                               {"role": "user", "content": "Tell me more."}]
    assert all(len(set(r)) == 1 for r in served.values()), served
    assert {r[0] for r in served.values()} == routed.replicas  # new sessions are spread


def test_a_hot_prefix_spreads_over_both_replicas_under_load(routed):
    def one(i: int) -> str:
        with routed.http() as http:
            return ask(http, turn(SUPPORT, f"Question number {i}: can you help?"),
                       max_tokens=16)

    with ThreadPoolExecutor(8) as pool:
        served = Counter(pool.map(one, range(32)))
    print(f"\nhot prefix, 32 requests at 8 in flight: {dict(served)}")
    assert set(served) == routed.replicas, served
    assert max(served.values()) <= 2 * min(served.values()), served


def test_every_kind_of_decision_reaches_the_metrics(routed):
    # After the tests above: new (first prompts), hit, session, spill (the hot prefix).
    deadline = time.monotonic() + 60
    while True:
        lines = [line for line in httpx.get(routed.metrics_url, timeout=10).text.splitlines()
                 if line.startswith("ray_mesh_replica_routing_decisions_total{")
                 and 'variant="smollm-v1"' in line]
        seen = {d for d in ("new", "hit", "session", "spill") if f'decision="{d}"' in " ".join(
            lines)}
        if len(seen) == 4:
            break
        assert time.monotonic() < deadline, f"decisions in the metrics: {sorted(seen)}"
        time.sleep(3)


def test_scale_down_under_load_fails_nothing_and_sessions_move_to_the_survivor(routed):
    failures: list[str] = []
    after: dict[str, str] = {}
    stop = threading.Event()

    def converse(s: str) -> None:
        with httpx.Client(base_url=routed.base_url, timeout=120) as http:
            streamed = s.endswith("1")
            while not stop.is_set():
                r = http.post("/v1/chat/completions", headers={"x-session-id": s}, json={
                    "model": "smollm", "max_tokens": 8, "stream": streamed,
                    "messages": [{"role": "user", "content": f"Caller {s} says hello."}]})
                if r.status_code == 200 and (not streamed or "data: [DONE]" in r.text):
                    after[s] = r.headers[REPLICA_HEADER]
                else:
                    failures.append(f"{r.status_code}: {r.text[:200]}")

    cfg = copy.deepcopy(routed.affinity_cfg)
    cfg["applications"][1]["deployments"][0]["num_replicas"] = 1
    threads = [threading.Thread(target=converse, args=(f"c{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        routed.deploy(cfg)
        survivor = routed.replica_ids("smollm-v1", "LLMReplica")
        time.sleep(5)  # requests after the scale-down
        after.clear()
        time.sleep(5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    assert failures == []
    assert len(survivor) == 1 and survivor < routed.replicas
    assert set(after.values()) == survivor, after  # every session on the replica left
