"""Scale to zero on the real stack: serve_configs/scale_to_zero.yaml (smollm-v1 always on,
canary smollm-v2 autoscaling with ``min_replicas: 0``), with short autoscaling delays so the
module stays short. An idle variant reaches zero replicas and its engine's memory comes
back; a herd of 200 at the variant at zero and 200 at a warm one get no 5xx but fast 503s
for what the cold start cannot hold, and one replica starts; a request the split sends to the
sleeping canary is served by smollm-v1 at once and wakes it; a stream in flight keeps its
variant up past the downscale delay. Then serve_configs/resident_budget.yaml in place (two
routes, one variant each, room for one engine): routes used alternately swap their variants,
and a variant with a request in flight is never evicted. Last, the dashboard's scale-to-zero
panels (cold starts, evictions) have data. The resident budget's tests start three engines
and run with ``--all`` (marked ``slow``); its rules are held without Ray by
test_resident_budget.py."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import httpx
import psutil
import pytest

from serve_app.request.split import pick_variant
from serve_app.tenancy.token_budget import Reservation
from bench import local_prometheus
from bench.drills import herd_table
from bench.loadgen import flood
from bench.servers import free_port

from tests.support.bodies import chat_body, post_chat
from tests.support.budgets import charged_between, day_refill
from tests.support.dashboard import dashboard
from tests.support.metrics import metric_total
from tests.support.replicas import replicas, running
from tests.support.waits import wait_for_metric, wait_until

pytestmark = pytest.mark.integration

OPS_KEY = "sk-mesh-ops-demo"  # admin tenant of the config
ADMIN = {"authorization": f"Bearer {OPS_KEY}"}  # /health's states are for admins
AUTH = {"authorization": f"Bearer {OPS_KEY}"}
CANARY = "smollm-v2"
STABLE = "smollm-v1"  # always on
#: Serve's autoscaling for the module: zero after ~look_back + delay of no requests.
SHORT = {"metrics_interval_s": 1, "look_back_period_s": 3, "downscale_delay_s": 5,
         "upscale_delay_s": 0, "max_replicas": 2}  # 2: "one replica started" can fail


#: The body :func:`chat` sends by default (what a request of it reserves).
CHAT_BODY = chat_body("What is 2 + 2?", temperature=0, max_tokens=8)


def chat(http: httpx.Client, **kw) -> httpx.Response:
    """:func:`post_chat` as the ops tenant."""
    return post_chat(http, key=OPS_KEY, **kw)


def stream_lines(base_url: str, pin: str, max_tokens: int = 8,
                 include_usage: bool = False) -> dict:
    """One streamed chat: its status, SSE comment lines, data lines, and seconds taken.
    ``include_usage``: ask for the usage chunk at the end (``stream_options``)."""
    t0 = time.monotonic()
    body = {"model": "smollm", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    out = {"comments": [], "data": []}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300,
                      headers={**AUTH, "x-mesh-variant": pin}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith(":"):
                out["comments"].append(line)
            elif line.startswith("data: "):
                out["data"].append(line[len("data: "):])
    out["seconds"] = time.monotonic() - t0
    return out


def canary_processes(mesh) -> list[psutil.Process]:
    """The canary's replica processes and their children (vLLM's EngineCore and Worker)."""
    procs = []
    for r in running(mesh):
        p = psutil.Process(r["pid"])
        procs += [p, *p.children(recursive=True)]
    return procs


@pytest.fixture(scope="module")
def sleepy(mesh):
    cfg = mesh.config("scale_to_zero.yaml")
    canary = next(a for a in cfg["applications"] if a["name"] == CANARY)
    canary["deployments"][0]["autoscaling_config"].update(SHORT)
    mesh.deploy(cfg)
    mesh.sleepy_cfg = cfg
    proc, mesh.sleepy_prometheus = local_prometheus.start(free_port())  # 5 s, as shipped
    yield mesh
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow  # memory given back: test_real_engine; reaching zero: the next tests wait
# for it from the deploy
def test_an_idle_variant_reaches_zero_and_its_memory_comes_back(sleepy):
    with sleepy.http() as http:
        if not running(sleepy):  # asleep since the deploy: wake it (a pinned request waits)
            assert chat(http, pin=CANARY).status_code == 200
        wait_until(lambda: running(sleepy), 60, "the canary runs")
        assert chat(http, pin=CANARY).status_code == 200
    last_request = time.monotonic()
    procs = canary_processes(sleepy)
    engine_bytes = sum(p.memory_full_info().uss for p in procs)
    used_before = psutil.virtual_memory().used
    wait_until(lambda: not replicas(sleepy), 120, "the idle canary has no replica")
    to_zero_s = time.monotonic() - last_request
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in procs), 30, "the canary's processes exit")
    freed = used_before - psutil.virtual_memory().used
    print(f"\n[scale-to-zero] zero replicas {to_zero_s:.0f} s after the last request; "
          f"its processes held {engine_bytes / 2**30:.2f} GiB (USS, {len(procs)} processes); "
          f"host used memory fell by {freed / 2**30:.2f} GiB")
    if sleepy.engine == "vllm":  # the sim holds no weights: test_real_engine checks it
        assert len(procs) >= 2  # the replica and vLLM's engine processes
        assert freed >= 0.8 * engine_bytes, (freed, engine_bytes)
    with sleepy.http() as http:  # the router reads Serve's status every few seconds
        wait_until(lambda: http.get("/health", headers=ADMIN).json()["scale_to_zero"][CANARY]["state"]
                   == "zero", 15, "the router sees the canary at zero")


HERD = 200  # requests at once at each variant, half of them streamed (issue 28)
HERD_QUEUE_TIMEOUT_S = 5  # so that the herd overflows what a cold start holds


def test_a_herd_at_zero_and_one_at_a_warm_variant_get_no_5xx_but_fast_503s(sleepy):
    """Issue 28: 200 requests (100 streams) at the canary at zero and 200 (100 streams) at the
    warm smollm-v1, all at once, with the route's queue_timeout_s at 5 s. No 500, no client
    timeout; the cold start starts one replica and holds what that replica can start within
    queue_timeout_s once warm (admission's rule: the held count is printed), and every held
    request is served in full (no held stream ends in an in-band error); every other request
    gets 503 with Retry-After before any byte. The warm variant's herd is admission's usual
    answer: what fits within queue_timeout_s, 503 ``overloaded`` for the rest."""
    wait_until(lambda: not replicas(sleepy), 120, "the canary is at zero")
    with sleepy.http() as http:  # the router reads Serve's status every few seconds
        wait_until(lambda: http.get("/health", headers=ADMIN).json()["scale_to_zero"].get(CANARY, {}).get(
            "state") == "zero", 30, "the router sees the canary at zero")
    short = copy.deepcopy(sleepy.sleepy_cfg)
    route = short["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]
    route["admission"] = {**route.get("admission", {}), "queue_timeout_s": HERD_QUEUE_TIMEOUT_S}
    sleepy.deploy(short)  # in place (a router user_config change)
    seen, stop = [], threading.Event()

    def watch():  # the canary's replica count
        while not stop.is_set():
            seen.append(len(replicas(sleepy)))
            time.sleep(0.5)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def herds():
        return await asyncio.gather(*(
            flood(f"{sleepy.base_url}/v1", OPS_KEY, requests=HERD, streams=HERD // 2,
                  timeout_s=300, headers={"x-mesh-variant": pin})
            for pin in (CANARY, "smollm-v1")))
    try:
        cold, warm = asyncio.run(herds())
    finally:
        stop.set()
        watcher.join()
        sleepy.deploy(sleepy.sleepy_cfg)
    for name, answers in (("at zero", cold), ("warm", warm)):
        print(f"\n[herd] {HERD} requests ({HERD // 2} streams) at the variant {name}:")
        for what, count, when in herd_table(answers):
            print(f"  {what:<45} {count:>4}  {when}")
    for answers in (cold, warm):
        assert {a.status for a in answers} <= {200, 503}, herd_table(answers)
        refused = [a for a in answers if a.status == 503]
        assert all(a.retry_after for a in refused), herd_table(answers)
        assert all(a.complete for a in answers if a.status == 200), herd_table(answers)
    held = [a for a in cold if a.status == 200]
    assert held and len(held) < HERD, herd_table(cold)  # it held some, refused the rest
    # a held stream got its headers and `: waiting for ...` comments, then the real chunks
    assert all(a.held for a in held if a.stream), herd_table(cold)
    assert {a.code for a in cold if a.status == 503} == {"overloaded"}, herd_table(cold)
    assert max(seen) == 1  # one replica for the whole herd
    wait_for_metric(sleepy, "ray_mesh_cold_starts_total", 1, 30, variant=CANARY,
                    outcome="started")


def test_the_split_serves_a_sleeping_canarys_callers_elsewhere_and_wakes_it(sleepy):
    wait_until(lambda: not replicas(sleepy), 120, "the canary is at zero")
    route = sleepy.sleepy_cfg["applications"][0]["deployments"][0]["user_config"]["routes"][
        "smollm"]
    weighted = [(v["application"], v["weight"]) for v in route["variants"]]
    user = next(f"user-{i}" for i in range(1000)
                if pick_variant(weighted, "smollm", f"user-{i}") == CANARY)
    with sleepy.http() as http:
        t0 = time.monotonic()
        r = chat(http, user=user)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.headers["x-mesh-variant"] == "smollm-v1"
        assert took < 10, took  # nobody waits for the canary's engine
        wait_until(lambda: running(sleepy), 180, "the request woke the canary")
        wait_until(lambda: chat(http, user=user).headers.get("x-mesh-variant") == CANARY, 30,
                   "the caller goes back to the canary once it runs", every_s=1)


def test_a_stream_in_flight_keeps_its_variant_up_past_the_downscale_delay(sleepy):
    wait_until(lambda: running(sleepy), 180, "the canary runs")
    before = {r["replica_id"] for r in running(sleepy)}
    tokens = 400  # ~20 s or more here: longer than look_back_period_s + downscale_delay_s
    s = stream_lines(sleepy.base_url, CANARY, max_tokens=tokens, include_usage=True)
    assert s["seconds"] > SHORT["look_back_period_s"] + SHORT["downscale_delay_s"], s["seconds"]
    assert s["status"] == 200 and s["data"][-1] == "[DONE]"
    usage = [json.loads(d)["usage"] for d in s["data"][:-1] if '"usage"' in d
             and json.loads(d).get("usage")]
    chunks = [d for d in s["data"][:-1] if json.loads(d).get("choices")]
    assert not any("error" in d for d in s["data"]) and len(chunks) >= 1
    assert {r["replica_id"] for r in running(sleepy)} == before
    assert usage and usage[-1]["completion_tokens"] == tokens, usage  # it ran to its end


BROKEN = "smollm-broken"  # a variant whose engine fails to start (sim.fail_start)
SLOW = "smollm-slow"  # a variant whose engine starts slower than its route waits
SLOW_ROUTE_TIMEOUT_S = 3


def test_a_variant_whose_engine_fails_to_start_gets_503_with_the_reason_and_backs_off(sleepy):
    """Issue 28: a variant at zero whose engine fails at start (``sim.fail_start``; on the
    real engine, a KV cache far larger than the host: vLLM's args pass the build-time check,
    its engine fails at start). The held request gets 503 ``cold_start_failed`` with the
    engine's reason once the controller reports the failed start, not at
    ``cold_start_timeout_s``; the next request, during the back-off, gets the same 503 at
    once with a Retry-After; the budget's view no longer counts it as starting. And a
    request for a route whose only variant starts slower than the route's
    ``cold_start_timeout_s`` (3 s; a sim replica's start takes ~15 s, a real engine's ~75 s)
    gets 503 ``cold_start_timeout`` at 3 s, and the start goes on to a warm variant (stopped
    while starting, the replica would hold the next deploy for Serve's
    ``graceful_shutdown_timeout_s``). Issue 27's settlement through the router: with a
    ``tokens_per_day`` budget, the three refused requests (each reserved before it was held)
    cost nothing: the bucket before and after, read from the answers of the warm variant
    around them, differs by what those answers cost."""
    cfg = copy.deepcopy(sleepy.sleepy_cfg)
    router = cfg["applications"][0]["deployments"][0]["user_config"]
    # 1,000 a day: about 40 tokens a request, a refill of 0.5 tokens over the test's ~45 s
    per_day = 1000
    next(t for t in router["tenants"] if t["id"] == "ops")["tokens_per_day"] = per_day
    broken = copy.deepcopy(next(a for a in cfg["applications"] if a["name"] == CANARY))
    broken["name"] = BROKEN
    if sleepy.engine == "sim":
        broken["args"]["sim"] = {**broken["args"]["sim"], "fail_start": "weights not found"}
    else:
        broken["runtime_env"] = {"env_vars": {**broken.get("runtime_env", {}).get(
            "env_vars", {}), "VLLM_CPU_KVCACHE_SPACE": "100000"}}  # GiB
    slow = copy.deepcopy(next(a for a in cfg["applications"] if a["name"] == CANARY))
    slow["name"] = SLOW
    if sleepy.engine == "sim":
        slow["args"]["sim"] = {**slow["args"]["sim"], "start_s": 5}  # + ~10 s of imports
    cfg["applications"] += [broken, slow]
    route = router["routes"]["smollm"]
    # smollm-slow is on smollm too, at weight 0: its wake gives up after the largest
    # cold_start_timeout_s of its routes (180 s), so the 3 s route's timeout is what ends
    # the request, not a failed start.
    route["variants"] += [{"application": BROKEN, "weight": 0}, {"application": SLOW,
                                                                  "weight": 0}]
    router["routes"][SLOW] = {"variants": [{"application": SLOW, "weight": 100}],
                              "cold_start_timeout_s": SLOW_ROUTE_TIMEOUT_S}
    sleepy.deploy(cfg)  # in place: new applications with no replica, weight-0 variants
    try:
        with sleepy.http() as http:
            wait_until(lambda: all(http.get("/health", headers=ADMIN).json()["scale_to_zero"].get(
                app, {}).get("state") == "zero" for app in (BROKEN, SLOW)), 30,
                "the router sees the broken and the slow variant at zero")
            before, t_before = chat(http, pin=STABLE), time.monotonic()
            t_slow = time.monotonic()
            timed_out = chat(http, model=SLOW)
            slow_s = time.monotonic() - t_slow
            t0 = time.monotonic()
            first = chat(http, pin=BROKEN)
            took = time.monotonic() - t0
            t1 = time.monotonic()
            again = chat(http, pin=BROKEN)
            again_s = time.monotonic() - t1
            state = http.get("/health", headers=ADMIN).json()["scale_to_zero"].get(BROKEN, {})
            after, t_after = chat(http, pin=STABLE), time.monotonic()
            wait_until(lambda: http.get("/health", headers=ADMIN).json()["scale_to_zero"].get(SLOW, {}).get(
                "state") == "warm", 180, "the slow variant's start goes on to warm")
    finally:
        sleepy.deploy(sleepy.sleepy_cfg)
    print(f"\n[failed start] 503 after {took:.1f} s: {first.json()['error']['message']}")
    print(f"[slow start] 503 after {slow_s:.1f} s: {timed_out.text}")
    assert timed_out.status_code == 503, timed_out.text
    assert timed_out.json()["error"]["code"] == "cold_start_timeout", timed_out.text
    assert int(timed_out.headers["retry-after"]) >= 1
    assert SLOW_ROUTE_TIMEOUT_S <= slow_s < SLOW_ROUTE_TIMEOUT_S + 5, slow_s
    for r in (first, again):
        assert r.status_code == 503 and r.json()["error"]["code"] == "cold_start_failed", r.text
        assert int(r.headers["retry-after"]) >= 1
    message = first.json()["error"]["message"]
    assert "its replica failed to start: " in message, message
    if sleepy.engine == "sim":
        assert "weights not found" in message, message
    route_timeout = route.get("cold_start_timeout_s", 180)
    assert took < route_timeout / 2, took  # the controller's report, not the timeout
    assert again_s < 1.0, again_s
    assert state.get("state") == "failed", state  # not "starting": out of the budget
    # What the tenant was charged between the two answers of the warm variant: the first
    # one's usage (its reservation is given back down to it), nothing for the three refusals.
    reserved = Reservation.of("chat", CHAT_BODY).total
    charged = charged_between(int(before.headers["x-ratelimit-remaining-tokens"]), reserved,
                              before.json()["usage"]["total_tokens"],
                              int(after.headers["x-ratelimit-remaining-tokens"]), reserved)
    refill = day_refill(per_day, t_after - t_before)
    print(f"[failed start] the three refused requests charged {charged} tokens (the bucket "
          f"refilled {refill:.1f} meanwhile)")
    assert -1 - refill <= charged <= 1  # 1: whole-token rounding of the header


# -- the resident budget (serve_configs/resident_budget.yaml) ---------------------------------

BUDGET_ROUTES = {"smollm": "smollm-v1", "smollm-fr": "smollm-fr-v1"}


@pytest.fixture(scope="module")
def budget(sleepy):
    """resident_budget.yaml deployed in place."""
    cfg = sleepy.config("resident_budget.yaml")
    for app in cfg["applications"][1:]:  # the YAML alias: both variants' one dict
        app["deployments"][0]["autoscaling_config"].update(metrics_interval_s=1,
                                                           look_back_period_s=3)
    sleepy.deploy(cfg)
    # The router learns that both scale to zero from a status poll after the deploy. Until
    # then it polls smollm-v1 as an always-on variant, which may wake it once after the
    # deploy stopped it (initial_replicas 0): the swaps below start from either state.
    with sleepy.http() as http:
        wait_until(lambda: sorted(http.get("/health", headers=ADMIN).json()["scale_to_zero"])
                   == sorted(BUDGET_ROUTES.values()), 60,
                   "the router sees both variants scale to zero", every_s=1)
    return sleepy


def evictions(mesh, app: str) -> float:
    return metric_total(mesh, "ray_mesh_resident_evictions_total", variant=app,
                        outcome="stopped")


@pytest.mark.slow  # the resident budget's swaps: 3 engine starts (test_resident_budget
# holds its rules without Ray)
def test_a_budget_of_one_swaps_two_routes_used_alternately(budget):
    apps = list(BUDGET_ROUTES.values())
    before = {app: evictions(budget, app) for app in apps}
    seen, stop = [], threading.Event()

    def watch():  # how many of the two variants have a replica (in any state)
        while not stop.is_set():
            seen.append(sum(bool(replicas(budget, app)) for app in apps))
            time.sleep(0.5)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    answers = []
    with budget.http() as http:
        for route in ["smollm", "smollm-fr", "smollm"]:
            t0 = time.monotonic()
            r = chat(http, model=route)
            answers.append((route, r.status_code, r.headers.get("x-mesh-variant"),
                            round(time.monotonic() - t0, 1)))
    stop.set()
    watcher.join()
    print(f"\n[resident budget] (route, status, variant, s): {answers}")
    assert [a[1] for a in answers] == [200] * 3, answers
    assert [a[2] for a in answers] == ["smollm-v1", "smollm-fr-v1", "smollm-v1"]
    assert max(seen) == 1  # never both: each swap waited for the other's replica to go
    for app in apps:  # each was evicted once to start the other
        wait_for_metric(budget, "ray_mesh_resident_evictions_total", before[app] + 1, 30,
                        variant=app, outcome="stopped")


def test_a_variant_with_a_request_in_flight_is_never_evicted(budget):
    """With a budget of one resident variant, smollm-v1 streaming: a request for smollm-fr
    gets 503 ``resident_budget_full`` at once, and the stream ends whole on the same
    replica (no eviction under a request)."""
    with budget.http() as http:  # wakes smollm-v1 if the deploy left it at zero
        assert chat(http, model="smollm").status_code == 200
    wait_until(lambda: running(budget, "smollm-v1"), 180, "smollm-v1 runs")
    before = {r["replica_id"] for r in running(budget, "smollm-v1")}
    body = {"model": "smollm", "messages": [{"role": "user", "content": "Count to 100."}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    with budget.http() as http, httpx.stream("POST", f"{budget.base_url}/v1/chat/completions",
                                             json=body, headers=AUTH, timeout=300) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        t0 = time.monotonic()
        refused = chat(http, model="smollm-fr")
        took = time.monotonic() - t0
        health = http.get("/health", headers=ADMIN).json()["resident_budget"]
        rest = [line for line in lines if line.startswith("data: ")]
    print(f"\n[resident budget] answered in {took:.2f} s while a stream ran: "
          f"{refused.status_code} {refused.text[:300]}")
    assert r.status_code == 200 and json.loads(first[len("data: "):])["choices"]
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "resident_budget_full"
    assert refused.headers["retry-after"] == "10" and took < 10
    assert health == {"max_variants": 1, "resident": ["smollm-v1"], "evicting": []}
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert {r["replica_id"] for r in running(budget, "smollm-v1")} == before
    assert not replicas(budget, "smollm-fr-v1")


@pytest.mark.slow  # its eviction panels read the resident budget's swaps above
def test_the_dashboards_scale_to_zero_panels_have_data(budget):
    """Their series come from this module's cold starts and evictions (test_observability
    checks the rest of the dashboard)."""
    build = dashboard()
    queries = build.queries({build.SCALE_TO_ZERO_ROW})
    assert len(queries) == 6
    missing = local_prometheus.without_data(budget.sleepy_prometheus, queries, 60, every_s=2)
    assert not missing, (f"panels without data: {missing}; failing scrapes: "
                         f"{local_prometheus.target_errors(budget.sleepy_prometheus)}")
