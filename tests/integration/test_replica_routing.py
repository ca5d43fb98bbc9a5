"""Cache-aware replica routing on the real stack: serve_configs/affinity.yaml (smollm-v1 with
two replicas, two vLLM engines, and the mesh's AffinityRouter) through the real router, with
the placement read from each response's x-mesh-replica header.

First of the integration modules: Serve reads a deployment's request router when a handle to
it is first made, so the router's handle to smollm-v1 must be made with this config. The
modules after it run one replica, where the router passes every request through.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import get_args

import httpx
import pytest

from tests.support.engines import signature
from tests.support.metrics import metric_total
from tests.support.waits import settled, wait_until
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.common.wire import REPLICA_HEADER
from serve_app.replica_routing.affinity import Decision
from bench.adapter_copies import register_copies
from bench.loadgen import LoadSpec, background_load, wait_for_results

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
        lines = [line for line in routed.metrics_text().splitlines()
                 if line.startswith("ray_mesh_replica_routing_decisions_total{")
                 and 'variant="smollm-v1"' in line]
        seen = {d for d in ("new", "hit", "session", "spill") if f'decision="{d}"' in " ".join(
            lines)}
        if len(seen) == 4:
            break
        assert time.monotonic() < deadline, f"decisions in the metrics: {sorted(seen)}"
        time.sleep(3)


# -- many adapters: 32 declared on the two replicas, at most 4 resident on each ------------

QUESTION = [{"role": "user", "content": "What is the largest ocean on Earth?"}]
MAX_RESIDENT = 4


@pytest.fixture(scope="module")
def many(routed, tmp_path_factory):
    """The same two replicas (an in-place user_config change), declaring 32 registered
    copies of the demo adapters. No teardown: the scale-down test below deploys its own."""
    manifest, names = register_copies(32, tmp_path_factory.mktemp("registry"))
    cfg = copy.deepcopy(routed.affinity_cfg)
    cfg["applications"][1]["deployments"][0]["user_config"] = {
        "adapters": [{"name": n, "version": 1} for n in names],
        "adapters_manifest": str(manifest), "max_adapters_per_replica": MAX_RESIDENT}
    routed.deploy(cfg)
    assert routed.replica_ids("smollm-v1", "LLMReplica") == routed.replicas  # not restarted
    routed.adapter_names, routed.many_cfg = names, cfg
    return routed


def behaviour(mesh, name: str) -> str:
    """How copy ``name`` opens its answers: on the sim its own label, on vLLM the trained
    phrase of the demo adapter it copies."""
    source = "acme-support@v1" if name.startswith("acme-support") else "globex-report@v1"
    return signature(mesh.engine, f"{name}@v1" if mesh.engine == "sim" else source)


def ask_adapter(http: httpx.Client, name: str, session: str | None = None,
                **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": f"smollm:{name}", "messages": QUESTION, "temperature": 0, "max_tokens": 12,
        **body}, headers={"x-session-id": session} if session else {})


def adapter_events(mesh) -> Counter:
    """(adapter, event) -> count over both replicas, from the real metrics endpoint."""
    out: Counter = Counter()
    for line in mesh.metrics_text().splitlines():
        if line.startswith("ray_mesh_adapter_events_total{") and 'variant="smollm-v1"' in line:
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:
                                                              line.index("}")].split(","))
            out[(labels["adapter"].strip('"'), labels["event"].strip('"'))] += float(
                line.rsplit(" ", 1)[1])
    return out


def settled_events(mesh) -> Counter:
    """:func:`adapter_events` once two reads agree (:func:`test_observability.settled`)."""
    return settled(lambda: adapter_events(mesh), timeout_s=100)


def resident_now(events: Counter, key: str) -> float:
    return events[(key, "loaded")] - events[(key, "evicted")] - events[(key, "unloaded")]


def test_32_declared_adapters_each_answer_with_their_behaviour(many):
    def one(name: str) -> tuple[str, httpx.Response]:
        with many.http() as http:
            return name, ask_adapter(http, name)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, many.adapter_names))
    for name, r in results:
        assert r.status_code == 200, (name, r.text)
        assert r.json()["choices"][0]["message"]["content"].startswith(behaviour(many, name)), \
            (name, r.json()["choices"][0]["message"]["content"])
        assert r.headers["x-mesh-adapter"] == f"{name}@v1"
    placed = Counter(r.headers[REPLICA_HEADER] for _, r in results)
    print(f"\n32 adapters at 4 in flight, placement: {dict(placed)}")
    assert set(placed) == many.replicas  # cold ones to the less loaded: both, not one
    events = settled_events(many)
    for name in many.adapter_names:  # every adapter was made resident somewhere
        assert events[(f"{name}@v1", "loaded")] >= 1, name
    lines = [line for line in many.metrics_text().splitlines()
             if line.startswith("ray_mesh_adapters_resident{") and 'variant="smollm-v1"' in line]
    gauge = [float(line.rsplit(" ", 1)[1]) for line in lines
             if any(r in line for r in many.replicas)]
    print(f"resident per replica: {gauge}; loads {sum(v for (_, e), v in events.items() if e == 'loaded'):.0f}, "
          f"evictions {sum(v for (_, e), v in events.items() if e == 'evicted'):.0f}")
    assert len(gauge) == 2 and all(1 <= g <= MAX_RESIDENT for g in gauge), lines


def test_no_adapter_is_evicted_while_a_stream_on_it_runs(many):
    held, others = many.adapter_names[0], many.adapter_names[-12:]
    before = settled_events(many)
    done: dict[str, httpx.Response] = {}

    def stream() -> None:
        with many.http() as http:
            done["stream"] = ask_adapter(http, held, session="long", stream=True,
                                         max_tokens=400, ignore_eos=True)

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(2)
    finished_during = 0
    with many.http() as http:
        for name in others:  # the same session: the stream's replica loads each in turn
            if not t.is_alive():
                break  # nothing loads after the stream: every eviction below was during it
            r = ask_adapter(http, name, session="long")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"].startswith(behaviour(many, name))
            finished_during += t.is_alive()
    t.join(timeout=300)
    r = done["stream"]
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.startswith(behaviour(many, held)), text[:200]
    assert not any("error" in c for c in chunks)
    print(f"\n{finished_during} of 12 other adapters loaded on the stream's replica while "
          "it ran")
    assert finished_during >= 8  # more than the 3 free slots: evictions happened around it
    after = settled_events(many)
    evicted = {k: after[(k, e)] - before[(k, e)] for (k, e) in after if e == "evicted"}
    print(f"evictions meanwhile: {sum(evicted.values()):.0f}")
    assert sum(evicted.values()) >= finished_during - MAX_RESIDENT  # some were resident
    assert evicted.get(f"{held}@v1", 0) == 0, evicted


def engine_states(mesh, app: str = "smollm-v1", replicas: int = 2) -> dict[int, dict]:
    """Each replica's :meth:`LLMReplica.stats` (the engine's own state included), by pid:
    handle calls until every replica has answered."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMReplica", app_name=app)
    states: dict[int, dict] = {}
    for _ in range(50):
        state = handle.stats.remote().result()
        states[state["pid"]] = state
        if len(states) == replicas:
            break
    return states


def test_clients_leaving_mid_stream_while_a_load_waits_never_lose_an_adapter_under_the_engine(
        many):
    """Issue 28: four streams hold the four adapter slots of the variant's one replica (it is
    scaled to one for this test, so nothing can go elsewhere); a request for a fifth adapter
    waits for a slot there; the four clients disconnect mid-stream. The fifth is served, and
    on the simulated engine its own state shows that no adapter was removed while the engine
    still ran a request on it (the generator chain is closed and the engine has let go
    before an adapter is released and unloaded)."""
    one = copy.deepcopy(many.many_cfg)
    one["applications"][1]["deployments"][0]["num_replicas"] = 1
    many.deploy(one)
    try:
        _four_leave_while_a_fifth_waits(many)
    finally:
        many.deploy(many.many_cfg)  # two replicas again


def _four_leave_while_a_fifth_waits(many) -> None:
    four, fifth, session = many.adapter_names[4:8], many.adapter_names[8], "leaving"
    streaming, leave = threading.Barrier(len(four) + 1, timeout=120), threading.Event()

    def stream(name: str) -> None:
        body = {"model": f"smollm:{name}", "messages": QUESTION, "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{many.base_url}/v1/chat/completions", json=body,
                          headers={"x-session-id": session}, timeout=120) as r:
            lines = r.iter_lines()
            while '"content"' not in next(lines):  # a token has come: it runs
                pass
            streaming.wait()
            leave.wait(timeout=120)
        # leaving the block closes the connection mid-stream: the client left

    threads = [threading.Thread(target=stream, args=(n,)) for n in four]
    for t in threads:
        t.start()
    streaming.wait()
    answer: dict[str, httpx.Response] = {}

    def ask_fifth() -> None:
        with many.http() as http:
            answer["fifth"] = ask_adapter(http, fifth, session=session)
    waiter = threading.Thread(target=ask_fifth)
    waiter.start()
    time.sleep(1.0)
    waited = waiter.is_alive()  # the replica's every slot is in use: its load waits
    leave.set()
    for t in [*threads, waiter]:
        t.join(timeout=120)
    r = answer["fifth"]
    assert waited, "the fifth adapter's request did not wait: the race was not run"
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"].startswith(behaviour(many, fifth))
    if many.engine == "sim":  # the simulated engine counts removals under a request
        states = engine_states(many, replicas=1)
        assert len(states) == 1 and all(s["lora_removed_in_use"] == 0
                                        for s in states.values()), states


@pytest.mark.slow  # packing a cold adapter onto one replica: unit/replica_routing/test_affinity.py
def test_a_burst_for_a_cold_adapter_loads_it_once(many):
    events = settled_events(many)
    cold = next(f"{n}@v1" for n in many.adapter_names[4:-12]
                if resident_now(events, f"{n}@v1") == 0)

    def one(_: int) -> httpx.Response:
        with many.http() as http:
            return ask_adapter(http, cold.partition("@")[0])

    with ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(one, range(8)))
    assert all(r.status_code == 200 for r in burst), [r.text for r in burst]
    assert len({r.headers[REPLICA_HEADER] for r in burst}) == 1  # one replica took the burst
    after = settled_events(many)
    assert after[(cold, "loaded")] - events[(cold, "loaded")] == 1, (cold, after)
    assert after[(cold, "waited")] - events[(cold, "waited")] >= 1


#: The replica router's decisions (a Ray counter) and those of rule 6 for smollm-v1.
DECISIONS, NEWCOMER = ("ray_mesh_replica_routing_decisions_total",
                       {"variant": "smollm-v1", "decision": "newcomer"})


def test_a_light_tenants_request_in_a_newcomer_slot_takes_the_newcomer_rule(routed):
    """Through the real router and Serve's handle: with token-fair admission keeping 2 of the
    16 engine slots (2 replicas x max_num_seqs 8) for newcomers and a heavy tenant holding
    the other 14, a light tenant's request starts in a newcomer slot, carries the mark to
    the AffinityRouter, which places it by rule 6 (docs/replica-routing.md, "Newcomers'
    requests"): the decision counter says so."""
    cfg = copy.deepcopy(routed.affinity_cfg)
    router = cfg["applications"][0]["deployments"][0]["user_config"]
    tenants = load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml")
    router["tenants"] = [t for t in tenants["applications"][0]["deployments"][0][
        "user_config"]["tenants"] if t["id"] in ("acme", "globex")]
    for t in router["tenants"]:
        t.pop("adapters", None)
    router["routes"]["smollm"]["admission"] = {"fairness": "tokens", "newcomer_slots": 2}
    routed.deploy(cfg)
    try:
        light_takes_the_newcomer_rule(routed)
    finally:
        routed.deploy(routed.affinity_cfg)  # open mode again: the next test sends no key


def light_takes_the_newcomer_rule(routed) -> None:
    """Light requests, a second apart, while the heavy tenant fills its busy share, until the
    decision counter shows one placed by rule 6 (each must be 200). Not three back to back,
    as before: a light request sent as the last one ends takes the slot admission keeps for
    its tenant (``anticipation_s``), a plain slot, while the heavy share is one short; and
    one that comes as a wave of heavy requests ends (same length, started together) finds
    the share not full. Both start at once, as they should, but not by rule 6. The failure
    message gives every decision the light requests got and the replicas before and after."""
    def decisions() -> dict[str, float]:  # each kind's count ("single": one candidate)
        return {d: metric_total(routed, DECISIONS, variant="smollm-v1", decision=d)
                for d in (*get_args(Decision), "single")}

    before, replicas = decisions(), routed.replica_ids("smollm-v1", "LLMReplica")
    heavy = LoadSpec(base_url=f"{routed.base_url}/v1", model="smollm",
                     api_key="sk-globex-demo", concurrency=16, requests=10**6,
                     duration_s=600, max_tokens=64, timeout_s=300)
    light: list[int] = []
    with background_load(heavy) as heavy_results:
        wait_for_results(heavy_results, 16)  # the engines full: the busy share held
        with httpx.Client(base_url=routed.base_url, timeout=120,
                          headers={"authorization": "Bearer sk-acme-demo"}) as http:

            def newcomer_counted() -> bool:
                """One light request; whether a rule-6 decision is counted by now (the
                cluster exports metrics every second: the last request's shows next time)."""
                r = http.post("/v1/chat/completions", json={
                    "model": "smollm", "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"Light caller {len(light)}."}]})
                assert r.status_code == 200, r.text
                light.append(r.status_code)
                return metric_total(routed, DECISIONS, **NEWCOMER) > before["newcomer"]

            try:
                wait_until(newcomer_counted, timeout_s=60, every_s=1.0,
                           what="a light request placed by rule 6 (newcomer)")
            except AssertionError as e:
                after = decisions()
                raise AssertionError(
                    f"{e}: smollm-v1's decisions during {len(light)} light requests "
                    f"{ {d: after[d] - before[d] for d in after} }; replicas before "
                    f"{sorted(replicas)}, now "
                    f"{sorted(routed.replica_ids('smollm-v1', 'LLMReplica'))}") from None
    assert all(r.ok for r in heavy_results), [r.error for r in heavy_results if not r.ok][:3]
    seen = metric_total(routed, DECISIONS, **NEWCOMER) - before["newcomer"]
    print(f"\nnewcomer decisions: {seen:g} after {len(light)} light requests")


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
