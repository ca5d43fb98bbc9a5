"""Overload is bounded (serve_configs/tenants.yaml): a flood of low-priority requests gets
answers or fast 503s with Retry-After and no client timeouts, while a high-priority
tenant keeps being served; the same flood with priorities off, in the same run, for
comparison. A CI-sized flood; `scripts/drill_overload.py --requests 400 --compare` is the
full-size drill (figures in the README)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.ingress.admission import ADMIT_MARGIN
from serve_app.tools.drills import (ARRIVAL_CODES, format_figures, overload_drill,
                                    without_priorities)

pytestmark = pytest.mark.integration

FLOOD = 100  # CI size; the README's drill sends 400
REFUSAL_P95_BOUND_MS = 2000
QUEUE_TIMEOUT_MS = 30_000  # tenants.yaml's queue_timeout_s


@pytest.fixture(scope="module")
def tenants(mesh):
    mesh.tenants_cfg = mesh.deploy_shipped("tenants.yaml")
    yield mesh
    mesh.deploy(mesh.tenants_cfg)


def drill(mesh) -> dict:
    return asyncio.run(overload_drill(f"{mesh.base_url}/v1", flood_key="sk-batch-demo",
                                      probe_key="sk-acme-demo", requests=FLOOD,
                                      queue_timeout_s=QUEUE_TIMEOUT_MS / 1000))


def test_flood_is_answered_or_refused_fast_and_priority_keeps_serving(tenants):
    on = drill(tenants)
    tenants.deploy(without_priorities(tenants.tenants_cfg))
    off = drill(tenants)
    print()
    for label, f in (("priority on", on), ("priority off", off)):
        print("\n".join(format_figures(label, f)))

    for f in (on, off):
        assert f["timeouts"] == 0 and f["other_errors"] == 0, f
        # Goodput: the queue holds what can start within queue_timeout_s (service time
        # under load, from the replicas' start-up measure until learned), not a fixed 4 per
        # slot. The ratio is the last answer's time over queue_timeout_s, and admission aims
        # at ADMIT_MARGIN (0.8) of it, so an exact estimate gives about 0.8: measured
        # 0.78-1.08 (1.06-1.09 before the margin); the fixed bound gave about 0.5.
        assert f["goodput_ratio"] >= 0.8 * ADMIT_MARGIN, f
        assert f["answered"] >= 8 and f["answered"] + sum(f["refused"].values()) == FLOOD
        assert set(f["refused"]) <= {429, 503} and f["refused"], f
        assert f["refusals_with_retry_after"] == sum(f["refused"].values())
        # No refusal waits past the request's deadline (queue_timeout_s), plus the host's cost
        # of a refusal: those at the deadline are the latest.
        assert f["refusal_p95_ms"] < QUEUE_TIMEOUT_MS + REFUSAL_P95_BOUND_MS, f
    # A refusal decided at arrival (`overloaded`) costs the proxy, the router and this
    # client about 5 ms of CPU each, on 2 cores shared with the engine
    # (docs/traffic-safety.md): 100 at once came back within 0.4-0.8 s p95 here, and
    # 1.06-1.52 s on a slow CI day; 2 s tells that host cost from a refusal that waited in a
    # queue. The others come later by design: a request that goes ahead of queued ones (a
    # better priority, or, without priorities, the token-fair order that puts the probe's
    # light tenant first) sheds those it pushes past their deadline when it arrives (`shed`:
    # 4 of 52 refusals at 22-26 s in a CI run without priorities; 15.1 and 26.4 s p95 in two
    # runs with them). Every refusal still comes before the deadline (asserted above).
    for f in (on, off):
        assert f["arrival_refusal_p95_ms"] < REFUSAL_P95_BOUND_MS, f
        assert set(f["refused_by_code"]) <= {*ARRIVAL_CODES, "shed", "queue_timeout"}, f
    late = sum(n for code, n in off["refused_by_code"].items() if code not in ARRIVAL_CODES)
    assert late <= sum(off["refused"].values()) / 2, off  # without priorities, most at arrival
    # The probe tenant is served in both runs: with priorities it goes first, and either way
    # the flood's tenant leaves it an engine slot (admission.newcomer_slots: a tenant with
    # requests in flight may not take the last one). Measured: during the flood p50 444 ms
    # (priority on) and 465 ms (off) against 283 and 288 ms idle; before newcomer_slots,
    # without priorities, the probe waited behind the flood (p50 off/on 5.1x).
    for f in (on, off):
        assert f["probe_errors"] == 0 and f["probe_requests"] >= 3, f
        assert f["flood_ttft_p50_ms"] <= 3 * f["idle_ttft_p50_ms"], f
