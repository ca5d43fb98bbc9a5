"""Token-fair admission held to its goal exactly, on the simulated engine (``sim_only``: time
follows the host's fitted profile at time_scale 0.25, ``conftest.TEST_SIM_ARGS``): a heavy
tenant (globex) keeps 16 long streams going (the engine runs 8 at once, the rest queue)
while a light tenant (acme) sends one short request at a time, at the same priority. With
``fairness: tokens`` the light tenant's TTFT p95 stays within 2x its TTFT p95 on the idle
mesh and it gets at least a quarter of the service (VTC's weighted tokens,
:func:`~serve_app.ingress.admission.service_cost`) while both are busy;
with ``fairness: fifo``, measured in the same run, it gets neither.

On real vLLM on this 2-core host the light request's first step runs beside 7 decoding
streams on cores the proxy and router share (measured: wait p95 1.19 s against 0.18 s idle),
so the 2x goal is held here, on the sim.
"""

from __future__ import annotations

import copy
import time

import pytest

from serve_app.ingress.admission import service_cost
from serve_app.observability.stats import percentile
from serve_app.tools.loadgen import LoadSpec, background_load, wait_for_results

pytestmark = [pytest.mark.integration, pytest.mark.sim_only]

HEAVY, LIGHT = "sk-globex-demo", "sk-acme-demo"
#: The light tenant's requests measured on the idle mesh (the baseline's TTFT p95).
IDLE_SAMPLES = 20


def fairness(cfg: dict, mode: str) -> dict:
    cfg = copy.deepcopy(cfg)
    route = cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]
    route["admission"] = {**route.get("admission", {}), "fairness": mode}
    return cfg


def light(mesh, requests: int | None = None, duration_s: float | None = None) -> LoadSpec:
    return LoadSpec(base_url=f"{mesh.base_url}/v1", model="smollm", api_key=LIGHT,
                    concurrency=1, requests=requests or 10**6, duration_s=duration_s,
                    max_tokens=8, timeout_s=300, prompt="Say hi.")


def contention(mesh, light_requests: int) -> dict:
    """The light tenant's TTFT p95 (or time to its refusal) and share of the service of the
    requests that ended while both tenants were busy."""
    heavy = LoadSpec(base_url=f"{mesh.base_url}/v1", model="smollm", api_key=HEAVY,
                     concurrency=16, max_tokens=64, duration_s=1800, timeout_s=300)
    with background_load(heavy) as heavy_results:
        wait_for_results(heavy_results, 10)  # the heavy tenant fills the engine and queue
        t0 = time.monotonic()
        with background_load(light(mesh, duration_s=1800)) as light_results:
            wait_for_results(light_results, light_requests)
        t1 = time.monotonic()
    for r in heavy_results + light_results:  # only the router's own refusals may come
        assert r.ok or r.status == 503, (r.status, r.error)
    ended = [r for r in heavy_results if r.ok and t0 <= r.started_at + r.latency_s <= t1]
    light_ok = [r for r in light_results if r.ok]

    def service(rs) -> float:
        return sum(service_cost(r.prompt_tokens, r.completion_tokens) for r in rs)
    return {"light_ttft_p95_s": percentile([r.ttft_s if r.ok else r.latency_s
                                            for r in light_results], 95),
            "light_served": len(light_ok), "light_refused": len(light_results) - len(light_ok),
            "light_share": service(light_ok) / max(1.0, service(light_ok) + service(ended))}


@pytest.fixture(scope="module")
def tenants(mesh):
    cfg = mesh.deploy_shipped("tenants.yaml")
    return mesh, cfg


def test_token_fair_admission_holds_a_light_tenants_ttft_and_share_against_a_heavy_queue(
        tenants):
    mesh, cfg = tenants
    mesh.deploy(fairness(cfg, "tokens"))
    # 20 idle samples: a p95 of 8 is one sample, and the host's noise in that one sample
    # moved the ratio from x1.76 to x2.06 between runs of the same code.
    with background_load(light(mesh, requests=IDLE_SAMPLES)) as idle_results:
        wait_for_results(idle_results, IDLE_SAMPLES)
    idle_p95 = percentile([r.ttft_s for r in idle_results], 95)
    fair = contention(mesh, 10)
    mesh.deploy(fairness(cfg, "fifo"))
    fifo = contention(mesh, 3)
    for label, f in (("token-fair", fair), ("FIFO", fifo)):
        print(f"\n{label}: light TTFT p95 {f['light_ttft_p95_s'] * 1000:.0f} ms (idle "
              f"{idle_p95 * 1000:.0f} ms: x{f['light_ttft_p95_s'] / idle_p95:.2f}), "
              f"{f['light_served']} served, {f['light_refused']} refused, "
              f"{f['light_share']:.1%} of the service")
    assert fair["light_refused"] == 0, fair
    assert fair["light_ttft_p95_s"] <= 2 * idle_p95, (fair, idle_p95)
    assert fair["light_share"] >= 0.25, fair
    # FIFO, the same run: the light request waits behind the heavy tenant's queue
    assert fifo["light_ttft_p95_s"] > 2 * idle_p95 and fifo["light_share"] < 0.25, fifo
