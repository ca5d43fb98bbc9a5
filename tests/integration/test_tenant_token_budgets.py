"""Tokens as the unit of tenancy (serve_configs/tenants.yaml): with two router replicas, a
budget that holds across both routers under concurrent streams, a stream the client abandons
settling to what it really streamed, a non-stream the client abandons charged its
reservation with its engine request stopped, vLLM's 400 costing nothing, an engine death
charging what streamed and the refusals until its replacement nothing, a window that
refills on time, a budget lease lost with its router replica (kill -9) expiring within its
TTL, and the kill drills of both ledger backends (token-fair admission:
test_fairness.py). The drills come last: they leave a day spent (acme's, globex's).
Budgets are given to globex and acme here; what they reserve is computed as the router does
(:mod:`serve_app.tenancy.token_budget`)."""

from __future__ import annotations

import copy
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import asyncio

import httpx
import pytest
import ray

from serve_app.tenancy.lease_terms import BUDGET_LEASE_TTL_S, RENEW_S
from serve_app.tenancy.ledger import KV_NAMESPACE, KV_PREFIX, SHARED_NAME, SHARED_NAMESPACE
from serve_app.tenancy.redis_ledger import RedisLedger
from serve_app.tenancy.token_budget import Reservation
from bench.servers import start_redis
from tests.support.budgets import charged_between, day_refill

pytestmark = pytest.mark.integration

KEYS = {"globex": "sk-globex-demo", "acme": "sk-acme-demo"}
STREAM = {"model": "smollm", "max_tokens": 48, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True},
          "messages": [{"role": "user", "content": "Count to fifty."}]}
SMALL = {"model": "smollm", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
#: A stream whose every chunk carries its usage so far (vLLM's continuous_usage_stats): the
#: tokens a client saw generated, to compare with what a cut stream is charged.
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def budgeted(cfg: dict, routers: int = 2, **limits: dict) -> dict:
    """``cfg`` with ``routers`` router replicas and ``limits`` per tenant id (None removes
    one)."""
    cfg = copy.deepcopy(cfg)
    router = cfg["applications"][0]["deployments"][0]
    router["num_replicas"] = routers
    for tenant in router["user_config"]["tenants"]:
        for key, value in limits.get(tenant["id"], {}).items():
            if value is None:
                tenant.pop(key, None)
            else:
                tenant[key] = value
    return cfg


@pytest.fixture(scope="module")
def budgets(mesh):
    """The mesh on tenants.yaml with two routers (a no-op after a module that left it so):
    the tests' deploys are then the in-place changes they check."""
    mesh.tenants_cfg = mesh.config("tenants.yaml")
    mesh.deploy(budgeted(mesh.tenants_cfg))
    return mesh


def stream(http: httpx.Client, tenant: str, body: dict, request_id: str,
           read_chunks: int | None = None) -> dict:
    """One streamed chat: status, headers, the error code, and the tokens (prompt +
    completion) the last usage it read reports: its usage chunk, or with
    :data:`CONTINUOUS` the last chunk read (0 when refused, or when none carried usage)."""
    headers = {"authorization": f"Bearer {KEYS[tenant]}", "x-request-id": request_id}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "headers": r.headers,
                    "code": r.json()["error"]["code"], "tokens": 0}
        tokens, chunks = 0, 0
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            if read_chunks is not None and chunks >= read_chunks:
                break  # the client leaves: closing the stream drops the connection
            if '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
                tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"status": 200, "headers": r.headers, "code": None, "tokens": tokens}


def small(http: httpx.Client, tenant: str) -> tuple[int, int]:
    """A 1-token chat: the tokens left after its reservation (header), and what it cost."""
    r = http.post("/v1/chat/completions", json=SMALL,
                  headers={"authorization": f"Bearer {KEYS[tenant]}"})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return int(r.headers["x-ratelimit-remaining-tokens"]), usage["total_tokens"]


def test_a_window_refills_on_time(budgets):
    """tokens_per_minute 600 (10 tokens/s): 1-token requests until the budget is spent,
    then 429 tokens_exhausted with Retry-After; after that many seconds the same request
    is served."""
    budgets.deploy(budgeted(budgets.tenants_cfg, globex={"tokens_per_minute": 600}), in_place=True)
    with budgets.http() as http:
        headers = {"authorization": f"Bearer {KEYS['globex']}"}
        for sent in range(1, 40):
            r = http.post("/v1/chat/completions", json=SMALL, headers=headers)
            if r.status_code != 200:
                break
            assert r.headers["x-ratelimit-limit-tokens"] == "600"
        assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_exhausted", r.text
        retry_after = int(r.headers["retry-after"])
        print(f"\nspent after {sent - 1} requests; Retry-After {retry_after} s, "
              f"reset {r.headers['x-ratelimit-reset-tokens']}, "
              f"remaining {r.headers['x-ratelimit-remaining-tokens']}")
        assert 1 <= retry_after <= 6  # (one reservation - what is left) / 10 tokens/s
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < Reservation.of("chat", SMALL).total
        time.sleep(retry_after)
        again = http.post("/v1/chat/completions", json=SMALL, headers=headers)
        assert again.status_code == 200, again.text


def test_a_budget_holds_across_two_routers_under_concurrent_streams(budgets):
    """tokens_per_day 600 (refills 0.007 tokens/s: a fixed budget here): waves of 6
    concurrent 48-token streams until every one is refused. The tokens served (vLLM's own
    usage) stay within the budget plus one request's reservation, and reach the budget
    minus one. Both router replicas served some (their access logs)."""
    budgets.deploy(budgeted(budgets.tenants_cfg,
                            globex={"tokens_per_minute": None, "tokens_per_day": 600}),
                   in_place=True)
    assert len(budgets.replica_ids("mesh", "MeshRouter")) == 2
    reservation = Reservation.of("chat", STREAM).total
    prefix = f"budget-{uuid.uuid4().hex[:8]}"
    served, refused, waves = 0, [], 0
    with budgets.http() as http, ThreadPoolExecutor(6) as pool:
        too_big = http.post("/v1/chat/completions", json={**SMALL, "max_tokens": 1000},
                            headers={"authorization": f"Bearer {KEYS['globex']}"})
        assert too_big.status_code == 400, too_big.text
        assert too_big.json()["error"]["code"] == "reservation_exceeds_budget"
        while waves < 10:
            waves += 1
            results = list(pool.map(lambda i: stream(http, "globex", STREAM,
                                                     f"{prefix}-{waves}-{i}"), range(6)))
            served += sum(r["tokens"] for r in results if r["status"] == 200)
            refused += [r for r in results if r["status"] != 200]
            if all(r["status"] == 429 for r in results):
                break
    print(f"\n{waves} waves: {served} tokens served of a 600 budget (reservation "
          f"{reservation} each), {len(refused)} refused")
    assert {r["code"] for r in refused} == {"tokens_exhausted"}
    assert all(r["headers"]["retry-after"] and r["headers"]["x-ratelimit-limit-tokens"] == "600"
               for r in refused)
    assert 600 - reservation < served <= 600 + reservation
    routers = [f for f in budgets.serve_logs.glob("replica_mesh_MeshRouter_*.log")
               if any(prefix in line for line in open(f))]
    assert len(routers) == 2, routers


def engine_unfinished() -> int:
    """Requests smollm-v1's engine runs now (its only replica's)."""
    from ray import serve

    replica = serve.get_deployment_handle("LLMReplica", app_name="smollm-v1")
    return replica.stats.remote().result()["engine_unfinished"]


def engine_stopped_s(left_at: float, bound_s: float = 5.0) -> float:
    """Seconds from ``left_at`` (a client leaving) until smollm-v1's engine runs nothing; fails
    past ``bound_s`` (the abandoned request would run on for its 1,500 tokens)."""
    while engine_unfinished() > 0:
        assert time.monotonic() - left_at < bound_s, "the engine still runs an abandoned request"
        time.sleep(0.2)
    return time.monotonic() - left_at


def test_an_abandoned_stream_settles_to_what_it_streamed(budgets):
    """A 1,500-token stream (reserving 1,500 + its prompt bound; long enough not to end by
    itself within the test's 3 s) that the client leaves after 10 chunks stops its engine
    request within 5 s and is charged the tokens generated up to the router's last relayed
    chunk (vLLM's prompt and completion counts so far), not its reservation nor one token
    per event."""
    budgets.deploy(budgeted(budgets.tenants_cfg, acme={"tokens_per_day": 5000}), in_place=True)
    long = {**STREAM, "max_tokens": 1500, "stream_options": CONTINUOUS}
    reservation = Reservation.of("chat", long)
    with budgets.http() as http:
        left_before, probe_cost = small(http, "acme")
        r = stream(http, "acme", long, f"abandon-{uuid.uuid4().hex[:8]}", read_chunks=10)
        assert r["status"] == 200
        stopped_s = engine_stopped_s(time.monotonic())
        time.sleep(max(0.0, 3 - stopped_s))  # the router sees the disconnect and settles
        left_after, _ = small(http, "acme")
    probe_reservation = Reservation.of("chat", SMALL).total
    abandoned = charged_between(left_before, probe_reservation, probe_cost, left_after,
                                probe_reservation)
    seen = r["tokens"]  # prompt + completion tokens of the last chunk the client read
    print(f"\nabandoned after 10 chunks: engine request stopped {stopped_s:.1f} s after the "
          f"client left; charged {abandoned} tokens, {seen} seen by the "
          f"client (prompt bound {reservation.prompt}, reservation {reservation.total})")
    assert seen > 0
    assert seen <= abandoned + 1  # +1: whole-token rounding of the header
    assert abandoned <= seen + 40  # 40: tokens generated while the client's leaving reached it


def test_an_abandoned_non_stream_is_charged_and_its_engine_request_stops(budgets):
    """Issue 27: a 1,500-token non-stream chat whose client leaves after 2 s was free (the
    cancel path settled with no usage). Now its engine request is aborted (the replica's
    engine holds nothing a moment later, long before 1,500 tokens would be generated) and
    it is charged its reservation (vLLM gives a non-stream's usage only with its answer)."""
    budgets.deploy(budgeted(budgets.tenants_cfg, acme={"tokens_per_day": 5000}), in_place=True)
    body = {**SMALL, "max_tokens": 1500, "ignore_eos": True}
    reservation = Reservation.of("chat", body).total
    with budgets.http() as http:
        assert engine_unfinished() == 0  # nothing left over from before
        left_before, probe_cost = small(http, "acme")
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=body, timeout=2.0,
                      headers={"authorization": f"Bearer {KEYS['acme']}"})
        stopped_s = engine_stopped_s(time.monotonic())
        time.sleep(0.5)  # the router's give-back is sent without waiting
        left_after, _ = small(http, "acme")
    probe_reservation = Reservation.of("chat", SMALL).total
    charged = charged_between(left_before, probe_reservation, probe_cost, left_after,
                              probe_reservation)
    print(f"\nabandoned non-stream: engine request stopped {stopped_s:.1f} s after the client "
          f"left; charged {charged} tokens (reservation "
          f"{reservation})")
    assert abs(charged - reservation) <= 1  # 1: whole-token rounding of the header


def test_a_4xx_from_vllm_costs_nothing(budgets):
    """vLLM's own 400 (a temperature it refuses, after the router reserved for the body)
    gives every reserved token back: nothing ran."""
    budgets.deploy(budgeted(budgets.tenants_cfg, acme={"tokens_per_day": 5000}), in_place=True)
    probe_reservation = Reservation.of("chat", SMALL).total
    with budgets.http() as http:
        left_before, probe_cost = small(http, "acme")
        bad = http.post("/v1/chat/completions", json={**SMALL, "temperature": -1},
                        headers={"authorization": f"Bearer {KEYS['acme']}"})
        assert bad.status_code == 400, bad.text
        time.sleep(0.5)  # the router's give-back is sent without waiting
        left_after, _ = small(http, "acme")
    charged = charged_between(left_before, probe_reservation, probe_cost, left_after,
                              probe_reservation)
    print(f"\nvLLM's 400: charged {charged} tokens")
    assert abs(charged) <= 1  # 1: whole-token rounding of the header


def test_an_engine_death_charges_what_streamed_and_the_refusals_meanwhile_nothing(budgets):
    """Issue 27, through the router: acme's 400-token stream loses its engine after 10
    events (``LLMReplica.kill_engine``: the simulated core dies as vLLM's EngineCore does)
    and is charged the tokens of its last chunk relayed (vLLM sends no usage chunk then;
    each chunk carried its usage so far);
    each request sent until Serve has replaced the replica is refused before any byte and
    costs nothing. The bucket after the first request served again says so."""
    from ray import serve

    # 1,000 a day: the stream's reservation (~470) and two probes fit; it refills 0.7 tokens a
    # minute, allowed for below (the wait for Serve's new replica took a minute in CI).
    per_day = 1000
    budgets.deploy(budgeted(budgets.tenants_cfg, acme={"tokens_per_day": per_day}), in_place=True)
    body = {**STREAM, "max_tokens": 400, "stream_options": CONTINUOUS}
    prompt = Reservation.of("chat", body).prompt
    probe_reservation = Reservation.of("chat", SMALL).total
    replica = serve.get_deployment_handle("LLMReplica", app_name="smollm-v1")
    headers = {"authorization": f"Bearer {KEYS['acme']}"}
    with budgets.http() as http:
        left_before, probe_cost = small(http, "acme")
        t_before = time.monotonic()
        events, content, last, seen = 0, 0, "", 0
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                last = line or last
                if line.startswith("data: {"):
                    events += 1
                    content += '"content":"' in line and '"content":""' not in line
                    if '"usage":{' in line:  # the tokens so far, as the router relayed them
                        usage = json.loads(line[6:])["usage"]
                        seen = usage["prompt_tokens"] + usage["completion_tokens"]
                    if events == 10:
                        replica.kill_engine.remote().result()
        assert last == "data: [DONE]"
        refused, t0 = [], time.monotonic()
        while True:  # until Serve has replaced the replica
            r = http.post("/v1/chat/completions", json=SMALL, headers=headers)
            if r.status_code == 200:
                break
            refused.append(r.status_code)
            assert r.status_code == 503 and time.monotonic() - t0 < 120, r.text
            time.sleep(0.5)
        left_after = int(r.headers["x-ratelimit-remaining-tokens"])
        refill = day_refill(per_day, time.monotonic() - t_before)
    charged = charged_between(left_before, probe_reservation, probe_cost, left_after,
                              probe_reservation)
    print(f"\nengine killed after 10 events: {content} tokens and {events} events reached "
          f"the client, {seen} tokens by their usage; charged {charged} (prompt bound "
          f"{prompt}, refilled {refill:.1f} "
          f"meanwhile); {len(refused)} requests refused meanwhile ({set(refused)})")
    assert content < 400  # the stream was cut
    # +1: whole-token rounding of the header; the refill over the wait is seen as a credit
    assert seen <= charged + refill + 1
    assert charged <= seen + 1  # what the router relayed, nothing for the 503s


def spend_to_429(http: httpx.Client, tenant: str) -> int:
    """1-token chats until the tenant's budget refuses one; returns how many were served."""
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    for served in range(60):
        r = http.post("/v1/chat/completions", json=SMALL, headers=headers)
        if r.status_code != 200:
            assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_exhausted", r.text
            return served
    raise AssertionError("60 requests and no 429")


def refused_for_tokens(http: httpx.Client, tenant: str) -> None:
    r = http.post("/v1/chat/completions", json=SMALL,
                  headers={"authorization": f"Bearer {KEYS[tenant]}"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_exhausted", r.text


def held_leases(tenant: str) -> dict[str, float]:
    """The budget leases the ledger actor holds for ``tenant``, as it last saved them in the
    GCS (it saves on every call that touches the tenant): lease id -> when the ledger
    expires it, wall-clock s (past: due, dropped at the tenant's next call)."""
    from ray.experimental.internal_kv import _internal_kv_get

    data = _internal_kv_get(KV_PREFIX + tenant.encode(), namespace=KV_NAMESPACE)
    holds = json.loads(data).get("holds", {}) if data else {}
    return {lease: hold["until"] for lease, hold in holds.items()}


def test_a_lease_lost_with_its_router_replica_expires_within_its_ttl(budgets):
    """A budget lease lost with its router replica (kill -9): globex, busy on both router
    replicas, holds a lease on each; one replica is killed while the load runs. Nothing
    renews its lease (its expiry stops moving while the survivor's is renewed), and the
    ledger drops it within BUDGET_LEASE_TTL_S (10 s, well inside a minute's window) of its
    last renewal, its unspent credit counted spent; globex is served after."""
    import os
    import signal
    import threading

    from ray.util.state import list_actors

    # a minute's budget, refilled at 100,000 tokens/s: the lost lease's credit, counted
    # spent, comes back within the test (a day's would not, after the tests before spent it)
    budgets.deploy(budgeted(budgets.tenants_cfg, globex={"tokens_per_day": None,
                                                         "tokens_per_minute": 6_000_000}))
    stop = threading.Event()

    def load() -> None:  # 4 in flight: each router sees 4+ requests a second
        def one(_: int) -> None:
            try:
                http.post("/v1/chat/completions", json=SMALL,
                          headers={"authorization": f"Bearer {KEYS['globex']}"})
            except httpx.TransportError:  # in flight on the replica killed: dropped with it
                pass
        with budgets.http() as http, ThreadPoolExecutor(4) as pool:
            while not stop.is_set():
                list(pool.map(one, range(4)))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        deadline = time.monotonic() + 30
        while len(held := held_leases("globex")) < 2:
            assert time.monotonic() < deadline, f"globex never held a lease on both: {held}"
            time.sleep(0.2)
        routers = [a for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True)
                   if a.class_name == "ServeReplica:mesh:MeshRouter"]
        assert len(routers) == 2, routers
        os.kill(routers[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        at_kill = held_leases("globex")
        time.sleep(3 * RENEW_S)  # the survivor renews (or gives back) its lease meanwhile
    finally:
        stop.set()
        loader.join(timeout=30)
    lost = [lease for lease, until in held_leases("globex").items()
            if at_kill.get(lease) == until]  # not renewed since the kill
    assert len(lost) == 1, (at_kill, held_leases("globex"))
    with budgets.http() as http:
        while lost[0] in held_leases("globex"):
            # a call that touches globex at the ledger drops a lease that is due (and saves)
            http.post("/v1/chat/completions", json=SMALL,
                      headers={"authorization": f"Bearer {KEYS['globex']}"})
            # due at its last renewal (before the kill) + its TTL; dropped by the next call
            # that touches globex (every 0.5 s here): 2 s of margin for that call on 2 cores
            assert time.monotonic() - killed_at < BUDGET_LEASE_TTL_S + 2.0, \
                f"the lost lease is still held: {held_leases('globex')}"
            time.sleep(0.5)
        gone_s = time.monotonic() - killed_at
        after = http.post("/v1/chat/completions", json=SMALL,
                          headers={"authorization": f"Bearer {KEYS['globex']}"})
    print(f"\nleases {sorted(at_kill)} held at the kill; the lost one, {lost[0]}, gone "
          f"{gone_s:.1f} s after it")
    assert after.status_code == 200, after.text
    # it went by its TTL, not sooner (nothing gave it back)
    assert gone_s >= BUDGET_LEASE_TTL_S - 2 * RENEW_S - 1, gone_s


def test_a_killed_ledger_actor_comes_back_with_the_budget_spent(budgets):
    """The kill drill for the default ledger: acme spends its tokens_per_day to a 429; the
    ledger actor is killed and Ray restarts it; it reads its buckets back from the GCS, so
    the next request is still a 429 and the actor itself says the day is spent."""
    budgets.deploy(budgeted(budgets.tenants_cfg, acme={"tokens_per_day": 300}), in_place=True)
    reservation = Reservation.of("chat", SMALL).total
    with budgets.http() as http:
        served = spend_to_429(http, "acme")
        actor = ray.get_actor(SHARED_NAME, namespace=SHARED_NAMESPACE)
        ray.kill(actor, no_restart=False)
        deadline = time.monotonic() + 60
        while True:  # Ray restarts it (max_restarts=-1)
            try:
                left = ray.get(actor.remaining.remote("acme"), timeout=5)
                break
            except (ray.exceptions.RayError, TimeoutError):
                assert time.monotonic() < deadline, "the ledger actor did not come back"
                time.sleep(0.5)
        print(f"\nacme spent its 300 tokens/day in {served} requests; the restarted actor "
              f"says {left} left")
        assert left["tokens_per_day"] < reservation
        refused_for_tokens(http, "acme")


def test_a_killed_redis_ledger_comes_back_with_the_budget_spent(budgets, tmp_path):
    """The kill drill for the redis ledger: the routers count in a real redis-server
    (appendonly); globex (no concurrency limit: its requests are counted on budget leases
    once it is busy) spends its tokens_per_day to a 429; the server is killed (SIGKILL) and
    started again on its data, leases and all; Redis says the day is spent, and spending
    to a 429 again gets nothing more than the budget held (what a lease still held)."""
    proc, url = start_redis(str(tmp_path))
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    cfg = budgeted(budgets.tenants_cfg, globex={"tokens_per_day": 300})
    cfg["applications"][0]["deployments"][0]["user_config"]["ledger"] = {
        "backend": "redis", "redis_url": url}
    reservation = Reservation.of("chat", SMALL).total
    try:
        budgets.deploy(cfg)
        with budgets.http() as http:
            served = spend_to_429(http, "globex")
            proc.kill()
            proc.wait()
            proc, _ = start_redis(str(tmp_path), port=port)
            left = asyncio.run(RedisLedger(url).remaining("globex"))
            after = spend_to_429(http, "globex")
        print(f"\nglobex spent its 300 tokens/day in {served} requests; Redis, restarted, "
              f"says {left} left; {after} more served after the restart")
        assert left["tokens_per_day"] < reservation
        # 1-token chats of 32 tokens each (prompt + completion): 300 tokens are 9 at most
        assert served + after <= 300 // 32, (served, after)
    finally:
        budgets.deploy(budgets.tenants_cfg)
        proc.kill()
