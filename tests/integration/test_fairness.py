"""Token-fair admission on the simulated engine (``sim_only``: time follows the host's fitted
profile at time_scale 0.25, ``tests.support.mesh.TEST_SIM_ARGS``): a heavy tenant (globex)
keeps 16 long streams going (the engine runs 8 at once, the rest queue in the router), at the same
priority as a light tenant (acme) with short requests. With ``fairness: tokens``:

- a light request sent one at a time starts at once: its wait in the router (its access
  log's ``queue_ms``) p95 is under one engine step of a full batch;
- the light tenant keeping 4 requests going (a backlog: then the order decides its share)
  gets at least a quarter of the service (VTC's weighted tokens,
  :func:`~serve_app.admission.fair_share.service_cost`) rendered while both are busy.

With ``fairness: fifo``, measured in the same run, it gets neither: its TTFT p95 passes 2x
its idle TTFT and its share stays under a quarter.

The issue's TTFT goal, p95 <= 2x idle, is printed, not asserted: what remains of a light
request's TTFT once admission adds nothing is the engine's (the rest of the step in
progress, then its own step of a full batch), 2.12x idle at p95 on this profile,
exact on the virtual clock (test_fleet_sim.py); here the host's fixed overhead dilutes it
(x0.9-x2.1 in the last runs).
"""

from __future__ import annotations

import copy
import time
import uuid

import pytest

from serve_app.admission.fair_share import service_cost
from serve_app.observability.stats import percentile
from serve_app.common.sim_profile import load_profile
from bench.loadgen import LoadSpec, background_load, wait_for_results

pytestmark = [pytest.mark.integration, pytest.mark.sim_only]

HEAVY, LIGHT = "sk-globex-demo", "sk-acme-demo"
#: The light tenant's requests measured on the idle mesh (the baseline's TTFT p95).
IDLE_SAMPLES = 10
#: One engine step of a full batch (8 running) at the suite's time scale, s.
FULL_STEP_S = load_profile("cpu-smollm2").decode_s(8) * 0.25


def fairness(cfg: dict, mode: str) -> dict:
    cfg = copy.deepcopy(cfg)
    route = cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]
    route["admission"] = {**route.get("admission", {}), "fairness": mode}
    return cfg


def light(mesh, requests: int | None = None, duration_s: float | None = None,
          concurrency: int = 1, request_id_prefix: str | None = None) -> LoadSpec:
    return LoadSpec(base_url=f"{mesh.base_url}/v1", model="smollm", api_key=LIGHT,
                    concurrency=concurrency, requests=requests or 10**6,
                    duration_s=duration_s, max_tokens=8, timeout_s=300, prompt="Say hi.",
                    request_id_prefix=request_id_prefix)


def service_in(results, t0: float, t1: float) -> float:
    """The service (:func:`service_cost`, tokens) the engine gave ``results`` between ``t0``
    and ``t1`` (monotonic s): a request's prompt when its first token came, its completion
    tokens spread evenly from then to its end. Counting whole requests that ended in the
    window instead measures how the heavy tenant's waves of ends fall in it (20-32 % for
    the same run length)."""
    total = 0.0
    for r in results:
        if not r.ok or r.ttft_s is None:
            continue
        first, end = r.started_at + r.ttft_s, r.started_at + r.latency_s
        if t0 <= first <= t1:
            total += service_cost(r.prompt_tokens, 0)
        overlap = max(0.0, min(end, t1) - max(first, t0))
        total += service_cost(0, r.completion_tokens) * overlap / max(1e-9, end - first)
    return total


def contention(mesh, light_requests: int, backlog_s: float) -> dict:
    """Against the heavy tenant's queue: the TTFT p95 (or time to its refusal) and the wait
    in the router p95 of a light tenant sending one request at a time, then the share of
    the service of the light tenant keeping 4 requests going for ``backlog_s`` (a backlog:
    a fair order decides its share, where one request at a time asks for less than a
    quarter, 15-20 %, and gets all of it)."""
    prefix = f"light-{uuid.uuid4().hex[:8]}"
    heavy = LoadSpec(base_url=f"{mesh.base_url}/v1", model="smollm", api_key=HEAVY,
                     concurrency=16, max_tokens=64, duration_s=1800, timeout_s=300)
    with background_load(heavy) as heavy_results:
        wait_for_results(heavy_results, 10)  # the heavy tenant fills the engine and queue
        t0 = time.monotonic()
        with background_load(light(mesh, duration_s=1800,
                                   request_id_prefix=prefix)) as light_results:
            wait_for_results(light_results, light_requests)
        t1 = time.monotonic()
        with background_load(light(mesh, duration_s=1800, concurrency=4)) as backlog:
            time.sleep(backlog_s)  # the measured window; its requests in flight then finish
            t2 = time.monotonic()
    for r in heavy_results + light_results + backlog:  # only the router's refusals may come
        assert r.ok or r.status == 503, (r.status, r.error)
    one_at_a_time = service_in(light_results, t0, t1)
    backlogged = service_in(backlog, t1, t2)
    access = mesh.router_access(prefix, len(light_results))
    return {"light_ttft_p95_s": percentile([r.ttft_s if r.ok else r.latency_s
                                            for r in light_results], 95),
            "light_router_wait_p95_s": percentile([e["queue_ms"] / 1000 for e in access], 95),
            "light_served": sum(r.ok for r in light_results),
            "light_refused": sum(not r.ok for r in light_results + backlog),
            "one_at_a_time_share":
                one_at_a_time / max(1.0, one_at_a_time + service_in(heavy_results, t0, t1)),
            "light_share": backlogged / max(1.0, backlogged + service_in(heavy_results, t1, t2))}


@pytest.fixture(scope="module")
def tenants(mesh):
    cfg = mesh.deploy_shipped("tenants.yaml")
    return mesh, cfg


def test_token_fair_admission_starts_a_light_tenant_at_once_and_gives_it_its_share(
        tenants):
    mesh, cfg = tenants
    mesh.deploy(fairness(cfg, "tokens"), in_place=True)
    with background_load(light(mesh, requests=IDLE_SAMPLES)) as idle_results:
        wait_for_results(idle_results, IDLE_SAMPLES)
    idle_p95 = percentile([r.ttft_s for r in idle_results], 95)
    fair = contention(mesh, 10, backlog_s=6)
    mesh.deploy(fairness(cfg, "fifo"), in_place=True)
    fifo = contention(mesh, 3, backlog_s=8)
    for label, f in (("token-fair", fair), ("FIFO", fifo)):
        print(f"\n{label}: light TTFT p95 {f['light_ttft_p95_s'] * 1000:.0f} ms (idle "
              f"{idle_p95 * 1000:.0f} ms: x{f['light_ttft_p95_s'] / idle_p95:.2f}; goal 2x), "
              f"router wait p95 {f['light_router_wait_p95_s'] * 1000:.1f} ms, "
              f"{f['light_served']} served, {f['light_refused']} refused; "
              f"{f['one_at_a_time_share']:.1%} of the service one request at a time, "
              f"{f['light_share']:.1%} with 4 going")
    assert fair["light_refused"] == 0, fair
    assert fair["light_router_wait_p95_s"] < FULL_STEP_S, fair
    assert fair["light_share"] >= 0.25, fair
    # FIFO, the same run: the light request waits behind the heavy tenant's queue
    assert fifo["light_ttft_p95_s"] > 2 * idle_p95 and fifo["light_share"] < 0.25, fifo
