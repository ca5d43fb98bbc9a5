"""Shadow traffic on the real stack (serve_configs/shadow.yaml: smollm-v1 answers, smollm-v2
is mirrored): an identical shadow agrees, a French one does not and the similarity shows it,
a failing or slow shadow never touches the client's answers, max_in_flight caps the
mirrors, and a rollout's shadow phase promotes a good canary and stops a bad one before it
gets any weight."""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.integration

OPS = {"authorization": "Bearer sk-mesh-ops-demo"}
FRENCH = {"system_prompt": "Always answer in French."}
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 3?",
             "Which planet is the largest?", "What do bees make?", "Name a big ocean.",
             "What language is spoken in Spain?", "How many legs does a spider have?",
             "What is the opposite of hot?", "Name a fruit that is yellow."]


def router(cfg):
    return cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]


def shadow_uc(cfg):
    return cfg["applications"][2]["deployments"][0]["user_config"]


def configured(base, *, shadow: dict | None = None, v2: dict | None = None,
               rollout: dict | None = None):
    cfg = copy.deepcopy(base)
    route = router(cfg)
    route.pop("shadow", None)
    if shadow is not None:
        route["shadow"] = {**base_shadow(base), **shadow}
    if rollout is not None:
        route["variants"] = [{"application": "smollm-v1", "weight": 100},
                             {"application": "smollm-v2", "weight": 0}]
        route["rollout"] = rollout
    cfg["applications"][2]["deployments"][0]["user_config"] = v2 or {}
    return cfg


def base_shadow(base) -> dict:
    return dict(router(base)["shadow"])


@pytest.fixture(scope="module")
def shadowed(mesh):
    mesh.base_cfg = mesh.deploy_shipped("shadow.yaml")
    return mesh


def ask(http: httpx.Client, i: int, stream: bool) -> tuple[int, str, float]:
    """One greedy request (caller `user-i`): status, the answer as the client got it, seconds."""
    body = {"model": "smollm", "temperature": 0, "max_tokens": 16, "user": f"user-{i}",
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
    t0 = time.monotonic()
    if not stream:
        r = http.post("/v1/chat/completions", json=body, headers=OPS)
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        return r.status_code, text, time.monotonic() - t0
    pieces = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                     headers=OPS) as r:
        for line in r.iter_lines():
            if line.startswith('data: {"id"'):
                pieces.append(line.split('"delta":', 1)[1].split('"finish_reason"')[0])
    return r.status_code, "".join(pieces), time.monotonic() - t0


def traffic(mesh, n: int = 10, concurrency: int = 2) -> list[tuple[int, str, float]]:
    """``n`` greedy requests, every other one streamed, ``concurrency`` at a time."""
    def one(i):
        with mesh.http() as http:
            return ask(http, i, stream=i % 2 == 1)
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def book(mesh) -> dict:
    with mesh.http() as http:
        r = http.get("/admin/shadows", headers=OPS)
    assert r.status_code == 200, r.text
    return r.json().get("smollm", {}).get("smollm-v2", {"compared": 0, "shadow_errors": 0})


def settled(mesh, compared_at_least: int, errors_at_least: int = 0, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        b = book(mesh)
        if b["compared"] >= compared_at_least and b["shadow_errors"] >= errors_at_least:
            return b
        assert time.monotonic() < deadline, b
        time.sleep(1)


def delta(before: dict, after: dict) -> dict:
    """Agreement and similarity of the comparisons between two snapshots."""
    n = after["compared"] - before["compared"]

    def total(b, k):
        return (b.get(k) or 0) * b["compared"]
    return {"compared": n, "agreement": (total(after, "agreement") - total(before, "agreement"))
            / n, "similarity": (total(after, "similarity") - total(before, "similarity")) / n}


def test_identical_shadow_agrees_and_a_french_one_does_not(shadowed):
    results = traffic(shadowed, 20)
    assert all(s == 200 for s, _, _ in results)
    same = settled(shadowed, 20)
    print(f"\nidentical shadow: {same}")
    assert same["agreement"] >= 0.95 and same["similarity"] >= 0.95
    assert same["shadow_errors"] == 0 and same["latency_ratio_p50"] is not None

    shadowed.deploy(configured(shadowed.base_cfg, shadow={}, v2=FRENCH), in_place=True)
    results = traffic(shadowed, 10)
    assert all(s == 200 for s, _, _ in results)
    french = delta(same, settled(shadowed, same["compared"] + 10))
    after = book(shadowed)
    print(f"French shadow: {french}; kept samples: {len(after.get('samples', []))}, e.g. "
          f"{after.get('samples', [{}])[-1]}")
    assert french["agreement"] <= 0.2 and french["similarity"] < same["similarity"] - 0.2
    assert 1 <= len(after["samples"]) <= 5  # keep_samples: 5, disagreeing pairs only


def test_a_failing_or_slow_shadow_never_touches_the_client(shadowed):
    shadowed.deploy(configured(shadowed.base_cfg), in_place=True)  # shadow off
    off = traffic(shadowed, 8)
    assert all(s == 200 for s, _, _ in off)
    before = book(shadowed)
    # A client that waited for its shadow would take longer than the delay. 15 s is longer
    # than the 8 requests take (about 10 s, 2 at a time), so the delayed mirrors generate
    # only after them: with a shorter delay they share these 2 CPUs with v1 and slow the
    # client's requests by their compute, not by waiting (6.2 s against a 5 s delay, once).
    delay_s = 15
    for v2, label in (({"fault_injection": {"error_rate": 1.0}}, "errors"),
                      ({"fault_injection": {"delay_rate": 1.0, "delay_ms": delay_s * 1000}},
                       f"{delay_s} s delay")):
        shadowed.deploy(configured(shadowed.base_cfg, shadow={}, v2=v2), in_place=True)
        on = traffic(shadowed, 8)
        print(f"\nshadow with {label}: client latencies "
              f"{sorted(round(t, 2) for _, _, t in on)} (shadow off: "
              f"{sorted(round(t, 2) for _, _, t in off)})")
        assert [(s, text) for s, text, _ in on] == [(s, text) for s, text, _ in off]
        assert max(t for _, _, t in on) < delay_s
    after = settled(shadowed, before["compared"] + 1, before["shadow_errors"] + 8)
    print(f"shadow book: {after}")
    # The delayed mirrors end up to delay_s later; the next test counts only its own.
    deadline = time.monotonic() + 2 * delay_s + 60
    while book(shadowed).get("in_flight"):
        assert time.monotonic() < deadline, book(shadowed)
        time.sleep(1)


def test_max_in_flight_caps_the_mirrors(shadowed):
    shadowed.deploy(configured(shadowed.base_cfg, shadow={"max_in_flight": 1},
                               v2={"fault_injection": {"delay_rate": 1.0, "delay_ms": 3000}}),
                    in_place=True)
    before = book(shadowed)
    results = traffic(shadowed, 8, concurrency=4)
    assert all(s == 200 for s, _, _ in results)
    time.sleep(4)
    after = settled(shadowed, before["compared"] + 1)
    mirrored = after["compared"] - before["compared"]
    print(f"\n8 requests, 4 at a time, max_in_flight 1: {mirrored} mirrored")
    assert 1 <= mirrored <= 4


def test_rollout_shadow_phase_promotes_a_good_canary_and_stops_a_bad_one(shadowed):
    rollout = {"steps": [50, 100], "min_requests": 3, "min_step_s": 2,
               "gates": {"max_ttft_p95_ratio": None, "max_latency_p95_ratio": None},
               "shadow": {"min_requests": 6, "max_latency_ratio": None}}
    for rid, v2, outcome in (("shadow-good", {}, "promoted"),
                             ("shadow-bad", FRENCH, "rolled_back")):
        shadowed.deploy(configured(shadowed.base_cfg, v2=v2, rollout={"id": rid, **rollout}),
                        in_place=True)
        served, deadline = [], time.monotonic() + 240
        with shadowed.http() as http:
            while (state := http.get("/admin/rollouts", headers=OPS).json()["smollm"])[
                    "state"] not in ("promoted", "rolled_back"):
                assert time.monotonic() < deadline, state["history"][-1]
                r = http.post("/v1/chat/completions", headers=OPS, json={
                    "model": "smollm", "temperature": 0, "max_tokens": 8,
                    "user": f"{rid}-{len(served)}",
                    "messages": [{"role": "user", "content": QUESTIONS[len(served) % 10]}]})
                assert r.status_code == 200
                served.append(r.headers["x-mesh-variant"])
        decisions = [d["decision"] for d in state["history"]]
        print(f"\n{rid}: {decisions}; {state['history'][1]['reason']}; "
              f"shadow figures {state['history'][1].get('shadow')}")
        assert state["state"] == outcome
        if outcome == "promoted":
            assert decisions == ["start", "shadow-pass", "advance", "promote"]
        else:
            assert decisions == ["start", "rollback"]
            assert state["history"][1]["reason"].startswith("shadow phase: agreement")
            assert "smollm-v2" not in served  # stopped before it served anyone
