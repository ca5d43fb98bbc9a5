#!/usr/bin/env python
"""The mesh at scale, by simulation (``bench.py --sim PROFILE``): the replica-routing and
admission policies measured on a fleet of simulated engines (:mod:`serve_app.sim.fleet`:
the mesh's own routing and admission code, engines priced by a profile, on a virtual clock),
against the same fleet without the feature, in one run. Every figure it prints is simulated
and says its profile.

Workloads (seeded; :mod:`serve_app.sim.workloads`), open-loop Poisson arrivals:

1. ``many-adapters``: ``--adapter-count`` adapters (1,000) with Zipf popularity on
   ``--replicas`` (32), ``max_cpu_loras`` 8 and ``max_loras`` 4 per engine. Routers:
   Serve's default, Serve's multiplexing, the mesh's affinity router, and it with adapter
   affinity off. Goal: goodput ≥ 2x the default router's, adapter loads per request ≤ 0.05.
2. ``sessions``: multi-turn conversations, per-tenant system prompts, growing histories.
   Routers: Serve's default, the mesh's affinity router, and it with prefix affinity off.
   Goal: TTFT p50 ≤ 0.5x the default router's, prefix-cache hit rate ≥ 0.8 of what the
   workload allows (one engine with an unbounded cache).
3. ``tenants``: 8 tenants, one heavy (backlogged at 1.25x the fleet's capacity), under the
   mesh's admission: token-fair against FIFO (``--newcomer-slots``: and with more slots kept
   from the heavy tenant, against its tokens/s). Goal: the light tenants' TTFT p95 ≤ 2x
   their TTFT p95 on the idle fleet.

Goodput: the highest arrival rate (the grid, then 3 bisections) at which TTFT p95 and TPOT
p95 are within the SLO (``--slo-ttft-s``, ``--slo-tpot-s``), for requests arriving after
``--warmup-s``.
Writes PNGs (TTFT p95 against arrival rate per router, TTFT CDFs) to ``--plots`` and the
figures to ``--json``. ``--router-cost`` times the mesh's replica-routing decision (the
real code) at 8, 32, ... replicas with 1,000 adapters resident across them.

    python scripts/bench.py --sim h100-llama3-8b [--workloads many-adapters sessions tenants]
        [--replicas 32] [--adapter-count 1000] [--rates 100 200 400] [--router-cost]
    python scripts/bench.py --sim cpu-smollm2 --small   # 2 replicas, 8 adapters
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_app.ingress.admission import ADMIT_MARGIN, VariantAdmission  # noqa: E402
from serve_app.ingress.refusals import Rejected  # noqa: E402
from serve_app.ingress.slots import Slot  # noqa: E402
from serve_app.observability.stats import percentile  # noqa: E402
from serve_app.sim.fleet import EngineLimits, Fleet, FleetRequest  # noqa: E402
from serve_app.sim.fleet_routing import Replayed, make_router  # noqa: E402
from serve_app.sim.profile import SimProfile, load_profile  # noqa: E402
from serve_app.sim.virtual_time import run_virtual  # noqa: E402
from serve_app.sim.workloads import (MAX_TOKENS, PROMPT_TOKENS, ClosedLoop,  # noqa: E402
                                     SessionQueue, Sessions, adapter_rank, many_adapters,
                                     reachable_hit_rate, tenants)

#: SLOs by profile when none is given: (TTFT p95 s, TPOT p95 s). The GPU one is a common
#: interactive target for an 8B chat model; the CPU one scales it to a 135M model on 2 cores.
DEFAULT_SLO = {"h100-llama3-8b": (1.0, 0.05), "cpu-smollm2": (10.0, 0.5)}
WORKLOADS = ("many-adapters", "sessions", "tenants")
#: Bisections of the arrival rate past the grid's last rate within the SLO.
REFINE_STEPS = 3
ROUTERS = {"many-adapters": ("default", "multiplex", "affinity", "affinity-no-adapter"),
           "sessions": ("default", "affinity", "affinity-no-prefix")}


def capacity_rps(profile: SimProfile, replicas: int, limits: EngineLimits,
                 max_tokens: float) -> float:
    """Requests/s a fleet decodes with full batches and nothing else to do (an upper bound
    that sets the rate grid)."""
    batch = limits.max_num_seqs
    return replicas * batch / (profile.decode_s(batch) * max_tokens)


def adapters_in_flight_needed(profile: SimProfile, replicas: int, limits: EngineLimits,
                              rate: float, weights: list[float], prompt_tokens: int,
                              max_tokens: float) -> float:
    """Distinct adapters with a request in flight, on average, that ``rate`` requests/s ask
    for with each adapter on one replica, the load spread evenly and no request waiting: an
    estimate, not a bound. A request then takes ``d`` s (its prefill step, then
    ``max_tokens`` - 1 steps of the even batch, each with ``max_loras`` adapters; a request's
    wait for its first step and other requests' prefills are left out), and adapter ``k``,
    asked with probability ``p_k``, has a request in flight for ``1 - exp(-rate * p_k * d)``
    of the time (Poisson arrivals; ``d`` is linear in the tokens, so the mean output serves).
    Well past the fleet's LoRA batch slots (``replicas`` x ``max_loras``), requests wait for
    one. Other placements need fewer: the hot adapters keep their slots busy whatever their
    replicas' steps take, so packing them on a few replicas shortens the other requests'.

    Args:
        weights: each adapter's popularity (any scale).
        prompt_tokens, max_tokens: a request's prompt and mean output, tokens.
    """
    total = sum(weights)
    d = 1.0
    for _ in range(50):  # d sets the batch, which sets d: iterate to the fixed point
        batch = max(1, round(rate * d / replicas))
        step = profile.step_s(batch=batch, prefill_tokens=0, adapters=limits.max_loras)
        prefill = profile.step_s(
            batch=batch, prefill_tokens=prompt_tokens, adapters=limits.max_loras,
            prefill_lengths=[prompt_tokens], lora_prefill_tokens=prompt_tokens) - step
        d = prefill + max_tokens * step
    return sum(1 - math.exp(-rate * w / total * d) for w in weights)


def tokens_per_s(requests: list[FleetRequest], t0: float, t1: float) -> float:
    """Completion tokens/s ``requests`` were served between ``t0`` and ``t1`` (virtual s),
    each request's tokens taken as even from its first token to its end."""
    tokens = 0.0
    for r in requests:
        if r.first_token_at is None or r.done_at is None or not r.generated:
            continue
        span = r.done_at - r.first_token_at
        overlap = min(r.done_at, t1) - max(r.first_token_at, t0)
        if span <= 0:
            tokens += r.generated if t0 <= r.done_at <= t1 else 0
        elif overlap > 0:
            tokens += r.generated * overlap / span
    return tokens / (t1 - t0)


def summarize(requests: list[FleetRequest], fleet: Fleet, warmup_s: float) -> dict:
    """Figures of one run over the requests that arrived after ``warmup_s``."""
    measured = [r for r in requests if r.arrival >= warmup_s]
    served = [r for r in measured if r.rejected is None]
    ttft = [r.ttft_s for r in served]
    tpot = [r.tpot_s for r in served if r.tpot_s is not None]
    prompt = sum(len(r.prompt_ids) for r in served)
    span = max((r.done_at for r in served), default=warmup_s) - warmup_s
    per_replica = [0] * fleet.replicas
    for r in served:
        per_replica[r.replica] += 1
    adapters = {}
    for r in served:
        if r.adapter:
            adapters.setdefault(r.replica, set()).add(r.adapter)
    return {
        "requests": len(measured), "rejected": len(measured) - len(served),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "tpot_p95_s": percentile(tpot, 95),
        "tokens_per_s": sum(r.generated for r in served) / span if span > 0 else 0.0,
        "adapter_loads_per_request": (sum(r.loaded_adapter for r in served) / len(served)
                                      if served else math.nan),
        "prefix_hit_rate": sum(r.cached_tokens for r in served) / prompt if prompt else 0.0,
        "hottest_replica_share": (max(per_replica) * fleet.replicas / len(served)
                                  if served else math.nan),
        "adapters_per_replica": (sum(len(s) for s in adapters.values()) / fleet.replicas
                                 if adapters else 0.0),
        "adapters_in_engines": statistics.fmean(
            [n for at, n, _ in fleet.adapters_in_flight if at >= warmup_s] or [0]),
        "distinct_adapters_in_flight": statistics.fmean(
            [d for at, _, d in fleet.adapters_in_flight if at >= warmup_s] or [0]),
        "lora_batch_slots": fleet.replicas * fleet.limits.max_loras,
        "ttft_s": sorted(ttft)}


def loads_by_popularity(requests: list[FleetRequest], hot: int, slots: int) -> dict:
    """Adapter loads per request of the many-adapters workload by the adapter's popularity
    rank: the ``hot`` most popular, the rest of the ``slots`` most popular (what the fleet's
    ``max_cpu_loras`` could keep resident), and the tail past them: {band: {requests,
    loads_per_request}}."""
    bands = {f"top {hot}": (0, hot), f"{hot}-{slots - 1}": (hot, slots),
             f"{slots}+": (slots, math.inf)}
    out = {}
    for band, (lo, hi) in bands.items():
        these = [r for r in requests if lo <= adapter_rank(r.adapter) < hi]
        out[band] = {"requests": len(these), "loads_per_request":
                     sum(r.loaded_adapter for r in these) / len(these) if these else 0.0}
    return out


def within_slo(s: dict, slo: tuple[float, float]) -> bool:
    return s["ttft_p95_s"] <= slo[0] and s["tpot_p95_s"] <= slo[1] and not s["rejected"]


def goodput(rows: dict[float, dict], slo: tuple[float, float]) -> float:
    """The highest rate measured below which every rate met the SLO (0: none)."""
    best = 0.0
    for rate in sorted(rows):
        if not within_slo(rows[rate], slo):
            break
        best = rate
    return best


def simulate(profile: SimProfile, replicas: int, limits: EngineLimits, router: str | Callable,
             requests: list[FleetRequest], follow_up=None, fairness: str | None = None,
             seed: int = 0, newcomer_slots: int = 1, adapter_imbalance_bound: int | None = None
             ) -> tuple[list[FleetRequest], Fleet]:
    """One run on a fresh fleet (``router``: a name of :data:`~serve_app.sim.fleet_routing.
    ROUTERS` or a factory ``fleet -> router``; ``fairness``: the mesh's admission in front,
    ``tokens`` or ``fifo``, with ``newcomer_slots``; None: none; ``adapter_imbalance_bound``:
    the mesh's router's, None: its default, each replica's ``max_num_seqs``)."""
    async def main():
        admission = None
        if fairness:
            admission = VariantAdmission("sim", queue_timeout_s=30.0, fairness=fairness,
                                         newcomer_slots=newcomer_slots,
                                         clock=asyncio.get_running_loop().time)
            admission.set_capacity(replicas * limits.max_num_seqs)
        fleet = Fleet(profile, replicas, limits, admission=admission, seed=seed)
        route = (make_router(router, seed, adapter_imbalance_bound=adapter_imbalance_bound)
                 if isinstance(router, str) else router)
        return await fleet.run(requests, route, follow_up), fleet
    return run_virtual(main())


def sweep(name: str, a, profile: SimProfile, limits: EngineLimits, rates: list[float],
          make_requests, slo: tuple[float, float]) -> dict:
    """Every router of workload ``name`` at every rate of the grid, then
    :data:`REFINE_STEPS` bisections between its last rate within the SLO and the next:
    {router: {rate: summary}}."""
    out: dict[str, dict[float, dict]] = {}
    for router in ROUTERS[name]:
        out[router] = by_rate = {}

        def measure(rate: float) -> dict:
            t0 = time.perf_counter()
            requests, follow_up = make_requests(rate)
            served, fleet = simulate(profile, a.replicas, limits, router, requests, follow_up,
                                     adapter_imbalance_bound=a.adapter_imbalance_bound)
            s = summarize(served, fleet, a.warmup_s)
            if name == "many-adapters":
                s["loads_by_popularity"] = loads_by_popularity(
                    [r for r in served if r.arrival >= a.warmup_s and r.rejected is None],
                    a.replicas, a.replicas * limits.max_cpu_loras)
            if name == "sessions":
                s["reachable_hit_rate"] = reachable_hit_rate(served, profile.block_size,
                                                             a.warmup_s)
            print(f"[sim {profile.name}] {name} {router:>19} {rate:>7.1f}/s: "
                  f"TTFT p50 {s['ttft_p50_s']:.3f} s p95 {s['ttft_p95_s']:.3f} s, TPOT p95 "
                  f"{s['tpot_p95_s'] * 1000:.1f} ms, {s['tokens_per_s']:.0f} tok/s, "
                  f"loads/req {s['adapter_loads_per_request']:.3f}, prefix hits "
                  f"{s['prefix_hit_rate']:.2f}, hottest replica x"
                  f"{s['hottest_replica_share']:.2f} ({time.perf_counter() - t0:.0f} s wall)",
                  flush=True)
            by_rate[rate] = s
            return s

        for rate in rates:
            measure(rate)
        lo = goodput(by_rate, slo)
        above = [r for r in sorted(by_rate) if r > lo]
        if above and lo:
            hi = above[0]
            for _ in range(REFINE_STEPS):
                mid = round((lo + hi) / 2, 1)
                if mid in by_rate:
                    break
                if within_slo(measure(mid), slo):
                    lo = mid
                else:
                    hi = mid
    return out

def _label(profile: SimProfile) -> str:
    return f"SIMULATED, profile {profile.name}"


def bench_many_adapters(a, profile: SimProfile, slo: tuple[float, float]) -> dict:
    limits = EngineLimits(max_num_seqs=a.max_num_seqs, max_loras=4, max_cpu_loras=8,
                          max_ongoing_requests=a.max_num_seqs)
    cap = capacity_rps(profile, a.replicas, limits, 128)
    rates = a.rates or [round(cap * f, 1) for f in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)]

    def make(rate):
        return many_adapters(rate, a.duration_s, adapters=a.adapter_count, zipf_s=a.zipf_s,
                             seed=a.seed), None

    rows = sweep("many-adapters", a, profile, limits, rates, make, slo)
    g = {router: goodput(r, slo) for router, r in rows.items()}
    weights = [1 / (k + 1) ** a.zipf_s for k in range(a.adapter_count)]
    slots = a.replicas * limits.max_cpu_loras
    bound = sum(weights[slots:]) / sum(weights)
    twice = 2 * g["default"]
    needed = adapters_in_flight_needed(  # many_adapters draws its output lengths uniformly
        profile, a.replicas, limits, twice, weights, PROMPT_TOKENS, statistics.mean(MAX_TOKENS))
    at = g["affinity"] or rates[0]  # affinity ran it
    loads = rows["affinity"][at]["adapter_loads_per_request"]
    ratio = g["affinity"] / g["default"] if g["default"] else math.inf
    print(f"\n[{_label(profile)}] many-adapters: {a.adapter_count} adapters (Zipf s="
          f"{a.zipf_s:g}), {a.replicas} replicas, max_cpu_loras 8, max_loras 4, "
          f"max_num_seqs {a.max_num_seqs}; SLO TTFT p95 <= {slo[0]:g} s, TPOT p95 <= "
          f"{slo[1] * 1000:g} ms")
    for router, rate in g.items():
        print(f"  goodput {router:>19}: {rate:g} requests/s")
    print(f"many-adapters goodput affinity/default {ratio:.2f}x (goal >= 2x): "
          f"{'met' if ratio >= 2 else 'NOT met'}")
    if twice:
        print(f"  2x the default's goodput, {twice:g} requests/s, keeps ~{needed:.0f} distinct "
              f"adapters in flight on average with each on one replica, the load even and "
              f"no request waiting (an estimate, not a bound), against "
              f"{a.replicas * limits.max_loras} LoRA batch slots ({a.replicas} x max_loras "
              f"{limits.max_loras})")
    print(f"many-adapters adapter loads per request (affinity at {at:g}/s) {loads:.3f} (goal "
          f"<= 0.05): {'met' if loads <= 0.05 else 'NOT met'}; the workload's bound with "
          f"{slots} adapter slots in the fleet (every request for an adapter past the "
          f"{slots} most popular loads it): {bound:.3f}")
    grid_rate = compared_at(rates, at)  # both ran it
    for router in ("default", "affinity"):
        bands = rows[router][grid_rate]["loads_by_popularity"]
        print(f"  {router} at {grid_rate:g}/s, adapter loads per request by popularity: "
              + ", ".join(f"{band}: {b['loads_per_request']:.2f} ({b['requests']} requests)"
                          for band, b in bands.items()))
    explain(rows, g, slo)
    return {"rates": rates, "routers": rows, "goodput": g, "ratio": ratio,
            "loads_per_request": loads, "loads_bound": bound,
            "adapters_in_flight_needed_at_2x": needed}


def bench_sessions(a, profile: SimProfile, slo: tuple[float, float]) -> dict:
    limits = EngineLimits(max_num_seqs=a.max_num_seqs, max_ongoing_requests=a.max_num_seqs)
    probe = Sessions(1.0, 1.0)
    cap = capacity_rps(profile, a.replicas, limits, sum(probe.max_tokens) / 2) / probe.mean_turns()
    rates = a.rates or [round(cap * f, 1) for f in (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0)]

    def make(rate):
        s = Sessions(rate, a.duration_s, seed=a.seed)
        return s.requests(), s.follow_up

    rows = sweep("sessions", a, profile, limits, rates, make, slo)
    g = {router: goodput(r, slo) for router, r in rows.items()}
    at = compared_at(rates, g["default"])
    d, f = rows["default"][at], rows["affinity"][at]
    ttft_ratio = f["ttft_p50_s"] / d["ttft_p50_s"]
    hit_share = f["prefix_hit_rate"] / f["reachable_hit_rate"]
    print(f"\n[{_label(profile)}] sessions: {a.replicas} replicas, conversations of 3-8 "
          f"turns, 16 system prompts of 512 tokens; rates in conversations/s")
    for router, rate in g.items():
        print(f"  goodput {router:>19}: {rate:g} conversations/s")
    print(f"sessions TTFT p50 affinity/default at {at:g} conversations/s {ttft_ratio:.2f}x "
          f"(goal <= 0.5x): {'met' if ttft_ratio <= 0.5 else 'NOT met'}")
    print(f"sessions prefix-cache hit rate {f['prefix_hit_rate']:.2f} of a reachable "
          f"{f['reachable_hit_rate']:.2f} = {hit_share:.2f} (goal >= 0.8): "
          f"{'met' if hit_share >= 0.8 else 'NOT met'}")
    explain(rows, g, slo)
    return {"rates": rates, "routers": rows, "goodput": g, "ttft_ratio": ttft_ratio,
            "hit_share": hit_share}


def bench_tenants(a, profile: SimProfile) -> dict:
    limits = EngineLimits(max_num_seqs=a.max_num_seqs,
                          max_ongoing_requests=math.ceil(a.max_num_seqs * 1.25))
    replicas = max(1, a.replicas // 4)
    cap = capacity_rps(profile, replicas, limits, 128)
    heavy, light = 1.25 * cap, 0.01 * cap

    def light_of(served):
        return [r for r in served if r.tenant != "heavy" and r.arrival >= a.warmup_s]

    runs = {}
    # The heavy tenant held to fewer of the engines' slots (newcomer_slots of the fleet's),
    # the trade the goal may need: light TTFT against the heavy tenant's tokens.
    capped = [(f"token-fair, newcomer_slots {k}", heavy, "tokens", k)
              for k in a.newcomer_slots if k != 1]
    for label, heavy_rate, fairness, k in [("idle", 0.0, "tokens", 1),
                                           ("token-fair", heavy, "tokens", 1),
                                           ("fifo", heavy, "fifo", 1)] + capped:
        requests = tenants(heavy_rate, light, a.duration_s, seed=a.seed)
        served, _ = simulate(profile, replicas, limits, "affinity", requests,
                             fairness=fairness, seed=a.seed, newcomer_slots=k)
        lights = light_of(served)
        ok = [r for r in lights if r.rejected is None]
        tokens = sum(r.generated for r in served if r.arrival >= a.warmup_s)
        runs[label] = {"light_ttft_p95_s": percentile([r.ttft_s for r in ok], 95),
                       "light_router_wait_p95_s": percentile(
                           [r.routed_at - r.arrival for r in ok], 95),
                       "light_engine_ttft_p50_s": percentile(
                           [r.first_token_at - r.routed_at for r in ok], 50),
                       "light_rejected": len(lights) - len(ok),
                       "light_token_share": (sum(r.generated for r in ok) / tokens
                                             if tokens else 0.0),
                       "heavy_rejected": sum(1 for r in served if r.tenant == "heavy"
                                             and r.rejected),
                       "heavy_tokens": tokens - sum(r.generated for r in ok),
                       "heavy_tokens_per_s": tokens_per_s(
                           [r for r in served if r.tenant == "heavy"], a.warmup_s,
                           a.duration_s),
                       "ttft_s": sorted(r.ttft_s for r in ok)}
    idle = runs["idle"]["light_ttft_p95_s"]
    print(f"\n[{_label(profile)}] tenants: {replicas} replicas, heavy tenant at {heavy:.0f}/s "
          f"(1.25x capacity: backlogged), 7 light at {light:.1f}/s each, the mesh's admission "
          "(queue_timeout_s 30, newcomer_slots 1)")
    for label, r in runs.items():
        print(f"  {label:>10}: heavy {r['heavy_tokens_per_s']:,.0f} tokens/s while the "
              f"light ones ran, light TTFT p95 "
              f"{r['light_ttft_p95_s']:.3f} s "
              f"(x{r['light_ttft_p95_s'] / idle:.2f} idle; in the router p95 "
              f"{r['light_router_wait_p95_s'] * 1000:.0f} ms, in the engine p50 "
              f"{r['light_engine_ttft_p50_s'] * 1000:.0f} ms), light rejected "
              f"{r['light_rejected']}, heavy rejected {r['heavy_rejected']}")
    fair = runs["token-fair"]["light_ttft_p95_s"] / idle
    print(f"tenants light TTFT p95 token-fair/idle x{fair:.2f} (goal <= 2x): "
          f"{'met' if fair <= 2 else 'NOT met'} with newcomer_slots 1 (the default); fifo x"
          f"{runs['fifo']['light_ttft_p95_s'] / idle:.2f}")
    met = None  # the fewest newcomer slots that meet the goal, and what the heavy tenant pays
    for label, _, _, k in sorted(capped, key=lambda c: c[3]):
        ratio = runs[label]["light_ttft_p95_s"] / idle
        if ratio <= 2:
            cost = 1 - (runs[label]["heavy_tokens_per_s"]
                        / runs["token-fair"]["heavy_tokens_per_s"])
            met = {"newcomer_slots": k, "ratio": ratio, "heavy_tokens_given_up": cost}
            print(f"  met with newcomer_slots {k} of the fleet's {replicas * a.max_num_seqs} "
                  f"slots: x{ratio:.2f} idle, for {cost:.1%} of the heavy tenant's tokens/s")
            break
    return {"replicas": replicas, "runs": runs, "fair_over_idle": fair, "met_with": met}


def compared_at(rates: list[float], rate: float) -> float:
    """The grid's (every router ran it) highest rate up to ``rate``, else its lowest."""
    return max([r for r in rates if r <= rate], default=min(rates))


def explain(rows: dict, g: dict, slo: tuple[float, float]) -> None:
    """Why each router stopped at its goodput, from its own figures at the next rate."""
    for router, by_rate in rows.items():
        over = [r for r in sorted(by_rate) if r > g[router]]
        if not over:
            print(f"  {router}: within the SLO at every rate of the grid")
            continue
        s = by_rate[over[0]]
        why = []
        if s["ttft_p95_s"] > slo[0]:
            why.append(f"TTFT p95 {s['ttft_p95_s']:.2f} s")
        if s["tpot_p95_s"] > slo[1]:
            why.append(f"TPOT p95 {s['tpot_p95_s'] * 1000:.0f} ms")
        print(f"  {router} at {over[0]:g}/s: {', '.join(why) or 'rejections'}; hottest "
              f"replica x{s['hottest_replica_share']:.2f} of a fair share, adapter loads/req "
              f"{s['adapter_loads_per_request']:.3f}, {s['adapters_per_replica']:.1f} "
              f"adapters served per replica, {s['adapters_in_engines']:.0f} adapters with a "
              f"request in the engines ({s['distinct_adapters_in_flight']:.0f} distinct; the "
              f"fleet's LoRA batch slots: {s['lora_batch_slots']}), prefix hits "
              f"{s['prefix_hit_rate']:.2f}")


def plot(results: dict, profile: SimProfile, slo: tuple[float, float], out: Path
         ) -> list[Path]:
    """PNGs: TTFT p95 against arrival rate per router, and TTFT CDFs (each titled as a
    simulation with its profile)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("many-adapters", "sessions"):
        if name not in results:
            continue
        r = results[name]
        unit = "requests/s" if name == "many-adapters" else "conversations/s"
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for router, by_rate in r["routers"].items():
            rates = sorted(by_rate)
            left.plot(rates, [by_rate[x]["ttft_p95_s"] for x in rates], marker="o",
                      label=f"{router} (goodput {r['goodput'][router]:g})")
        left.axhline(slo[0], color="grey", linestyle="--", label=f"SLO {slo[0]:g} s")
        left.set(xlabel=f"arrival rate ({unit}, Poisson)", ylabel="TTFT p95 (s)",
                 yscale="log", title="TTFT p95 against arrival rate")
        left.legend(fontsize=8)
        # where the default router leaves the SLO (or the grid's top)
        at = min([x for x in r["rates"] if x > r["goodput"]["default"]], default=r["rates"][-1])
        for router, by_rate in r["routers"].items():
            ttft = by_rate[at]["ttft_s"]
            right.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=router)
        right.set(xlabel="TTFT (s)", ylabel="share of requests", xscale="log",
                  title=f"TTFT CDF at {at:g} {unit}")
        right.legend(fontsize=8)
        fig.suptitle(f"{name}: {_label(profile)} ({profile.description[:70]})", fontsize=9)
        fig.tight_layout()
        path = out / f"sim-{profile.name}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if "tenants" in results:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        runs = results["tenants"]["runs"]
        idle = runs["idle"]["light_ttft_p95_s"]
        for label, run in runs.items():
            ttft = run["ttft_s"]
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))],
                    label=f"{label}: p95 x{run['light_ttft_p95_s'] / idle:.2f} idle")
        ax.axvline(2 * idle, color="grey", linestyle="--", label="goal: p95 <= 2x idle")
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
        ax.set(xlabel="light tenants' TTFT (s)", ylabel="share of requests", xscale="log",
               title=f"tenants: {_label(profile)}")
        ax.legend(fontsize=7, loc="center")
        fig.tight_layout()
        path = out / f"sim-{profile.name}-tenants.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def router_cost(sizes: list[int], adapters: int = 1000, requests: int = 3000) -> list[dict]:
    """The mesh's replica-routing decision (what ``AffinityRouter.choose_replicas`` and
    ``on_request_routed`` run per request: routing stats read, prefix keys, adapter holders,
    the choice, the record), timed with ``time.perf_counter`` on this host, with
    ``adapters`` adapters resident across ``n`` replicas (8 each, spread), for each ``n``."""
    import random
    from types import SimpleNamespace

    from serve_app.ingress.replica_affinity import ReplicaAffinity, prefix_keys
    from serve_app.ingress.replica_router import rank_replicas

    rng = random.Random(0)
    reqs = many_adapters(100.0, requests / 100.0, adapters=adapters, seed=1)
    rows = []
    for n in sizes:
        replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats={
            "adapters": [f"lora-{(i * 8 + j) % adapters}@v1" for j in range(8)], "at": 0.0,
            "max_loras": 4, "max_num_seqs": 64}) for i in range(n)]
        by_id = {r.replica_id: r for r in replicas}
        affinity = ReplicaAffinity()
        times = []
        for i, req in enumerate(reqs):
            queue_len = {r.replica_id: rng.randrange(8) for r in replicas}
            t0 = time.perf_counter()
            loads = {r.replica_id: queue_len[r.replica_id] for r in replicas}
            keys = prefix_keys(req.text, req.adapter)
            choice = rank_replicas(affinity, keys, None, req.adapter, loads, replicas)
            ranks = [[by_id[rid] for rid in rank] for rank in choice.ranks]
            affinity.record(keys, None, ranks[0][0].replica_id, req.adapter, at=float(i))
            times.append(time.perf_counter() - t0)
        rows.append({"replicas": n, "adapters": adapters,
                     "p50_ms": percentile(times, 50) * 1000,
                     "p99_ms": percentile(times, 99) * 1000})
        print(f"[router cost, this host] {n:>5} replicas, {adapters} adapters resident: "
              f"decision p50 {rows[-1]['p50_ms']:.3f} ms, p99 {rows[-1]['p99_ms']:.3f} ms",
              flush=True)
    return rows


def affinity_table_memory(replicas: int = 1000) -> float:
    """MiB one router's :class:`ReplicaAffinity` holds at its LRU bounds (``MAX_BLOCKS`` block
    keys, ``MAX_SESSIONS`` sessions, ``MAX_ADAPTER_ROUTES`` adapter routes) over ``replicas``
    replicas (tracemalloc)."""
    import tracemalloc

    from serve_app.ingress.replica_affinity import (MAX_ADAPTER_ROUTES, MAX_BLOCKS,
                                                    MAX_SESSIONS, ReplicaAffinity)

    tracemalloc.start()
    table = ReplicaAffinity()
    for i in range(MAX_BLOCKS):
        table.record([i.to_bytes(8, "big")], f"s{i}" if i < MAX_SESSIONS else None,
                     i % replicas, f"lora-{i % MAX_ADAPTER_ROUTES}@v1" if i < MAX_ADAPTER_ROUTES
                     else None)
    held = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    print(f"[router memory, this host] the affinity table at its bounds over {replicas} "
          f"replicas: {held:.0f} MiB", flush=True)
    return held


def admission_cost(depths: list[int], tenants_n: int = 8, samples: int = 300) -> list[dict]:
    """The mesh's admission (:class:`VariantAdmission`, token-fair, 8 tenants taking turns,
    64 slots of 1 s as measured at start-up) per request with about ``depth`` requests
    queued: one ``enter`` and one ``release`` (which grants the head of the queue), timed on
    this host, in two queues:

    - ``far``: deadlines far off (``queue_timeout_s`` 1e9, the clock still);
    - ``overloaded`` (``depth`` 100 or more): an overload built on the virtual clock, 80
      requests a second arriving and 50 ending (the engines slower than measured: a request
      holds its slot 1.6 s), ``queue_timeout_s`` set so the queue would stop growing near
      ``depth``; once 0.9 ``depth`` are queued, timed at 50 arrivals and 50 ends a second.
      The oldest requests are then near their deadlines, so shedding checks some of them
      one by one.

    ``far`` queues ``depth`` beyond the 16 of headroom the best priority may also run
    (:data:`~serve_app.ingress.admission.HEADROOM`), which a busy tenant may not use.
    """
    rows = []
    for depth in depths:
        for case in ("far", "overloaded") if depth >= 100 else ("far",):
            async def main():
                clock = asyncio.get_running_loop().time
                # overloaded: the queue holds what starts within ADMIT_MARGIN x the timeout,
                # ~63 slots of 1.6 s: ~40 a second
                timeout = 1e9 if case == "far" else depth / 40 / ADMIT_MARGIN
                adm = VariantAdmission("sim", queue_timeout_s=timeout, fairness="tokens",
                                       newcomer_slots=1, clock=clock)
                adm.set_capacity(64, full_batch_service_s=1.0)
                slots, pending, ended = [], [], 0.0
                times: list[float] = []

                def arrive_and_end(i: int, end: bool) -> None:
                    """One arrival (refused or not) and, if ``end``, one end."""
                    nonlocal slots, pending
                    t0 = time.perf_counter()
                    try:
                        ticket = adm.enter(0, True, f"t{i % tenants_n}")
                        (slots if isinstance(ticket, Slot) else pending).append(ticket)
                    except Rejected:
                        pass
                    if end and slots:
                        adm.release(slots.pop(0), 100.0, 1.0)
                    if timing:
                        times.append(time.perf_counter() - t0)
                    slots += [w.future.result() for w in pending
                              if w.future.done() and w.future.exception() is None]
                    pending = [w for w in pending if not w.future.done()]

                timing, i = False, 0
                if case == "far":  # a queue of depth at once, then an end with each arrival
                    while adm.queued < depth + 16:
                        arrive_and_end(i, False)
                        i += 1
                else:  # the overload until the queue is near its bound
                    while adm.queued < 0.9 * depth:
                        if i > 10 * depth:  # it grows ~30 a second, 80 arrivals: ~3 x depth
                            raise RuntimeError(f"admission_cost: the queue stopped at "
                                               f"{adm.queued}, short of 0.9 x {depth}")
                        arrive_and_end(i, ended >= 1)
                        ended = ended % 1 + 50 / 80
                        await asyncio.sleep(1 / 80)
                        i += 1
                queued, timing = adm.queued, True
                for _ in range(samples):
                    i += 1
                    arrive_and_end(i, True)
                    await asyncio.sleep(0.0 if case == "far" else 1 / 50)
                return times, queued, adm.queued

            times, queued, at_end = run_virtual(main())
            rows.append({"queued": queued, "case": case, "queued_at_end": at_end,
                         "p50_ms": percentile(times, 50) * 1000,
                         "p99_ms": percentile(times, 99) * 1000})
            print(f"[admission cost, this host] {queued:>6} queued, {case:<12}: enter + release "
                  f"p50 {rows[-1]['p50_ms']:.3f} ms, p99 {rows[-1]['p99_ms']:.3f} ms "
                  f"({at_end} queued at the end)", flush=True)
    return rows


def run(a) -> None:
    """The whole benchmark (see the module docstring); ``a``: bench.py's arguments."""
    profile = load_profile(a.sim)
    if a.small:
        a.replicas, a.adapter_count = 2, 8
    slo = (a.slo_ttft_s or DEFAULT_SLO.get(profile.name, (None,))[0],
           a.slo_tpot_s or DEFAULT_SLO.get(profile.name, (None, None))[1])
    if None in slo:
        raise SystemExit(f"profile {profile.name} has no default SLO: pass --slo-ttft-s and "
                         "--slo-tpot-s")
    print(f"[bench --sim] {_label(profile)}: {profile.description}\n  source: "
          f"{profile.source[:160]}...", flush=True)
    results: dict = {"profile": profile.name, "slo": slo, "date": time.strftime("%Y-%m-%d")}
    if "many-adapters" in a.workloads:
        results["many-adapters"] = bench_many_adapters(a, profile, slo)
    if "sessions" in a.workloads:
        results["sessions"] = bench_sessions(a, profile, slo)
    if "tenants" in a.workloads:
        results["tenants"] = bench_tenants(a, profile)
    if a.trust:
        results["trust"] = trust()
    if a.router_cost is not None:
        results["router_cost"] = router_cost(a.router_cost or [8, 32, 128, 512, 1000])
        results["admission_cost"] = admission_cost([0, 100] if a.small else
                                                   [0, 100, 1000, 5000, 20000])
        if not a.small:  # filling the table to its bounds takes a minute
            results["affinity_table_mib"] = affinity_table_memory()
    for path in plot(results, profile, slo, Path(a.plots)):
        print(f"[bench --sim] wrote {path}")
    if a.json:  # every figure but the per-request TTFTs (the plots have them)
        Path(a.json).write_text(json.dumps(_without(results, "ttft_s"), indent=1,
                                           default=str))
        print(f"[bench --sim] figures written to {a.json}")


#: Engine limits of the real runs :data:`TRUST_RUNS` replays (serve_configs/affinity.yaml's
#: smollm-v1, and vLLM's own server started with the same args).
AFFINITY_LIMITS = EngineLimits(max_num_seqs=8, max_loras=2, max_cpu_loras=4,
                               max_num_batched_tokens=2048, max_ongoing_requests=64)
K16 = tuple(f"copy-{i}@v1" for i in range(16))
ADAPTERS_CMD = "bench.py --adapters 16 --max-tokens 32 (48 requests; 2026-12-05, 04:45)"
SESSIONS_CMD = ("bench.py --sessions 24 --turns 4 --prefix-tokens 1500 --in-flight 4 "
                "--max-tokens 16 (2026-12-05, {})")


@dataclass(frozen=True)
class SessionsRun:
    """One real run of SESSIONS_CMD, per router: tokens/s, TTFT p50 (s), the cores each
    engine's workers got, the prefix-cache hit rate, and the replica each session's turns
    went to (its last output lines)."""

    at: str
    affinity: tuple[float, float, float, float, str]
    default: tuple[float, float, float, float, str]


SESSIONS_RUNS = [
    SessionsRun("00:31", (14.93, 0.379, 0.85, 0.737,
                          "0000 1111 1111 0000 1111 1111 0000 0000 1111 1111 0000 0000 "
                          "0000 1111 1111 0000 1111 1111 0000 0000 1111 1111 0000 0000"),
                (6.68, 4.945, 0.87, 0.221,
                 "0101 1010 1101 1111 0011 0110 0101 1010 1001 0110 0101 1001 "
                 "1010 0110 0101 1001 1010 0101 0010 1101 1010 0010 0101 1101")),
    SessionsRun("01:12", (14.34, 0.468, 0.84, 0.7353,
                          "1111 0000 1111 0000 1111 0000 0000 1111 1111 1111 0000 0000 "
                          "0000 1111 1111 0000 0000 1111 0000 1111 0000 1111 0000 1111"),
                (6.19, 4.902, 0.87, 0.140,
                 "0101 1010 0101 1010 0101 0101 1111 1111 1010 1010 0101 0101 "
                 "1010 1010 0101 0101 1010 1010 0101 0101 1010 1010 0101 0100")),
    SessionsRun("02:10", (14.67, 0.401, 0.85, 0.737,
                          "0000 1111 1111 0000 1111 1111 0000 0000 1111 1111 0000 0000 "
                          "1111 1111 0000 0000 1111 1111 0000 0000 1111 1111 0000 0000"),
                (9.16, 1.165, 0.86, 0.472,
                 "1011 0110 1011 0110 0011 0011 1100 1100 1100 1100 0011 0011 "
                 "1101 1101 0010 0010 1110 1110 0001 0001 1110 1110 0011 0011")),
]


@dataclass(frozen=True)
class TrustRun:
    """A run of real vLLM on this host (docs/benchmarks.md), on the same day as the profile's
    calibration (the host's speed moves 3-4x from day to day): where it ran (``direct``:
    vLLM's own server, one engine, no mesh; ``mesh``: through the mesh, whose processes
    share the 2 cores with the engines), replicas, the replica router, the load, the real
    tokens/s, TTFT p50 (s), the cores each engine's workers got during the run (``busy
    engines x worker cores each`` in the benchmark's table:
    :class:`~serve_app.tools.host_cpu.EngineShare`), the prefix-cache hit rate (None: not
    a prefix load) and, for a sessions run, the replica each turn went to (``placement``, as
    ``bench_sessions`` prints it: a digit a turn, a group a session), which the replay
    follows when ``replay_placement`` (:class:`~serve_app.sim.fleet_routing.Replayed`, each
    replica running at most its share of the requests in flight: the most Serve's default
    router lets one run when it sends each request to the less loaded; assumed, the benchmark
    does not record it), else it routes with ``router``."""

    name: str
    source: str
    where: str
    replicas: int
    router: str
    load: Callable[[], object]
    tokens_per_s: float
    ttft_p50_s: float
    worker_cores: float
    hit_rate: float | None = None
    placement: str | None = None
    replay_placement: bool = False

    def __post_init__(self) -> None:
        if self.worker_cores <= 0:
            raise ValueError(f"TrustRun {self.name!r}: worker_cores must be > 0 (the cores the "
                             "run's engine workers got, from its table); 0 means no vLLM "
                             "engine was measured")
        digits = set(self.placement or "") - {" "}
        if not digits <= set("0123456789"[:self.replicas]):
            raise ValueError(f"TrustRun {self.name!r}: placement has {sorted(digits)}; it "
                             f"holds replica indexes below {self.replicas}, as bench_sessions "
                             "prints them (a turn it lost, '?', cannot be replayed)")
        if self.replay_placement and not self.placement:
            raise ValueError(f"TrustRun {self.name!r}: replay_placement needs the placement")

    def router_for(self, work) -> str | Callable:
        """The replay's router for one seed's ``work`` (a :class:`SessionQueue` when the run
        replays its placement).

        Raises:
            ValueError: the placement's sessions and turns are not the load's.
        """
        if not self.replay_placement:
            return self.router
        sessions = self.placement.split()
        if [len(turns) for turns in sessions] != [len(p) for p in work.prompts]:
            raise ValueError(f"TrustRun {self.name!r}: the placement has sessions of "
                             f"{[len(t) for t in sessions]} turns, the load "
                             f"{[len(p) for p in work.prompts]}")
        share = math.ceil(work.in_flight / self.replicas)
        return lambda fleet: Replayed(lambda req: int(
            sessions[int(req.session[1:])][work.turn(req)]), max_in_flight=share)


def base_only():
    return ClosedLoop(48, 8, 35, 32)  # the run's 8 warm-up requests before it are not replayed


def k16():
    return ClosedLoop(48, 8, 35, 32, K16)


def sessions():
    return SessionQueue(session_prompts(), 4, 16)


TRUST_RUNS = [
    TrustRun("base-only, vLLM's own server", ADAPTERS_CMD, "direct", 1, "default", base_only,
             98.2, 0.725, 0.98),
    TrustRun("K=16 adapters, vLLM's own server", ADAPTERS_CMD, "direct", 1, "default", k16,
             19.7, 9.821, 0.99),
    TrustRun("base-only, mesh, 1 replica", ADAPTERS_CMD, "mesh", 1, "default", base_only,
             73.0, 0.778, 0.86),
    TrustRun("base-only, mesh, 2 replicas", ADAPTERS_CMD, "mesh", 2, "default", base_only,
             91.6, 0.474, 0.71),
    TrustRun("K=16 adapters, affinity", ADAPTERS_CMD, "mesh", 2, "affinity", k16, 29.4, 4.638,
             0.80),
    TrustRun("K=16 adapters, default", ADAPTERS_CMD, "mesh", 2, "default", k16, 29.6, 4.709,
             0.79),
] + [TrustRun(f"sessions {run.at}, {router}{', its placement replayed' * replayed}",
               SESSIONS_CMD.format(run.at), "mesh", 2, router, sessions, *figures,
               replay_placement=replayed)
      for run in SESSIONS_RUNS
      for router, figures, replayed in (("affinity", run.affinity, False),
                                        ("default", run.default, False),
                                        ("default", run.default, True))]
#: The run whose engine had the host as the profile's calibration did (one engine, no Ray):
#: every run is replayed on the profile slowed by its engines' worker cores against this one's.
HOST_REFERENCE = "base-only, vLLM's own server"
#: This host's profile fitted within the hour of :data:`TRUST_RUNS` (the shipped
#: ``cpu-smollm2``, that the sim tier's tests are built on, is of a day when the host ran
#: 2-3x slower).
TRUST_PROFILE = "cpu-smollm2-trust"
#: Seeds of each replay (Serve's default router picks at random, engine steps vary); the
#: figures are their medians, with their range.
TRUST_SEEDS = tuple(range(8))


@functools.cache
def session_prompts() -> list[list[tuple[int, ...]]]:
    """SESSIONS_CMD's prompts, token by token as that run sent them (its chat template and
    tokenizer: ~1,500 tokens a first turn, 21 more a turn)."""
    import bench_sessions

    from serve_app.common.serve_configs import load_yaml

    tokenizer = bench_sessions.tokenizer_of(load_yaml(bench_sessions.CONFIG))
    return bench_sessions.prompt_token_ids(tokenizer, sessions=24, turns=4,
                                           prefix_tokens=1500, tenants=4)


def same_replica_share(sessions: list[list]) -> float | None:
    """Of the sessions' turns after their first, the share that went to the replica of the
    turn before (``sessions``: each one's replicas, turn by turn; None: no second turn)."""
    pairs = [(a, b) for turns in sessions for a, b in zip(turns, turns[1:])]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def replay(run: TrustRun, scale: float) -> dict[str, tuple[float, float, float]]:
    """``run`` on the sim (:data:`TRUST_PROFILE`, every duration x ``scale``) once for each
    of :data:`TRUST_SEEDS`: the (median, least, most) of its tokens/s, TTFT p50 s (sessions:
    over the turns after the first, as that benchmark reports), prefix-cache hit rate and,
    for sessions, :func:`same_replica_share`; for a replayed placement, also the TTFT p50
    from the request's routing on (``ttft_p50_routed_s``)."""
    profile = load_profile(TRUST_PROFILE).scaled(scale)
    figures = []
    for seed in TRUST_SEEDS:
        work = run.load()
        served, fleet = simulate(profile, run.replicas, AFFINITY_LIMITS, run.router_for(work),
                                 work.requests(), work.follow_up, seed=seed)
        later = [r for r in served if not isinstance(work, SessionQueue) or work.turn(r)]
        whole = summarize(served, fleet, 0.0)  # every request arrives from 0 s on
        figures.append({"tokens_per_s": whole["tokens_per_s"],
                        "ttft_p50_s": percentile([r.ttft_s for r in later], 50),
                        "hit_rate": whole["prefix_hit_rate"]})
        if run.replay_placement:  # without the wait for the placed replica, which the real
            # run did not have: its timing freed that replica's slot as the request came
            figures[-1]["ttft_p50_routed_s"] = percentile(
                [r.first_token_at - r.routed_at for r in later], 50)
        if isinstance(work, SessionQueue):
            turns: dict[str, dict[int, int]] = {}
            for r in served:
                turns.setdefault(r.session, {})[work.turn(r)] = r.replica
            if (same := same_replica_share([[t[i] for i in sorted(t)]
                                            for t in turns.values()])) is not None:
                figures[-1]["same_replica"] = same
    return {k: (statistics.median(v), min(v), max(v))
            for k in figures[0] for v in [[f[k] for f in figures]]}


def trust() -> list[dict]:
    """Each run of :data:`TRUST_RUNS` on the sim beside the real figures, with each one's
    error (sim / real - 1). A run's every duration is x its time scale: the cores
    :data:`HOST_REFERENCE`'s engine workers got / those each of the run's engines' workers
    got (the mesh's processes and a second engine take theirs from the same 2 cores; the
    profile is of one engine alone). Read off the run's processes, not fitted to its
    tokens/s."""
    reference = next(r for r in TRUST_RUNS if r.name == HOST_REFERENCE)
    rows = []
    for run in TRUST_RUNS:
        scale = reference.worker_cores / run.worker_cores
        sim = replay(run, scale)
        row = {"run": run.name, "source": run.source, "where": run.where,
               "router": run.router, "placement_replayed": run.replay_placement,
               "worker_cores": run.worker_cores, "time_scale": round(scale, 3)}
        same = same_replica_share([list(t) for t in (run.placement or "").split()])
        same = None if same is None else round(same, 3)
        for key, real in (("tokens_per_s", run.tokens_per_s), ("ttft_p50_s", run.ttft_p50_s),
                          ("ttft_p50_routed_s", run.ttft_p50_s), ("hit_rate", run.hit_rate),
                          ("same_replica", same)):
            if real is not None and key in sim:  # routed: a replayed placement's only
                median, least, most = sim[key]
                row[key] = {"real": real, "sim": round(median, 3),
                            "sim_range": [round(least, 3), round(most, 3)],
                            "error": round(median / real - 1, 3) if real else None}
        rows.append(row)

        def shown(key: str, unit: str = "") -> str:
            f = row[key]
            error = "" if f["error"] is None else f"{f['error']:+.0%}; "
            return (f"real {f['real']:.2f}{unit} sim {f['sim']:.2f}{unit} ({error}"
                    f"seeds {f['sim_range'][0]:.2f}-{f['sim_range'][1]:.2f})")
        hits = f"; hit rate {shown('hit_rate')}" if run.hit_rate is not None else ""
        if same is not None:
            hits += f"; a next turn on its last turn's replica {shown('same_replica')}"
        if "ttft_p50_routed_s" in row:
            hits += (f"; TTFT p50 from its routing on (the replay's wait for the placed "
                     f"replica left out) {shown('ttft_p50_routed_s', ' s')}")
        print(f"[trust, {TRUST_PROFILE} x{scale:.2f}] {run.name}: tokens/s "
              f"{shown('tokens_per_s')}; TTFT p50 {shown('ttft_p50_s', ' s')}{hits}",
              flush=True)
    return rows


def _without(value, key: str):
    if isinstance(value, dict):
        return {k: _without(v, key) for k, v in value.items() if k != key}
    return [_without(v, key) for v in value] if isinstance(value, list) else value


def add_arguments(parser) -> None:
    """``bench.py --sim``'s options."""
    g = parser.add_argument_group("--sim PROFILE (the mesh at scale, simulated)")
    g.add_argument("--sim", metavar="PROFILE",
                   help="simulate a fleet of engines of this profile (serve_app/sim/profiles)")
    g.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS),
                   help="which to run (none: only --trust or --router-cost)")
    g.add_argument("--replicas", type=int, default=32, help="replicas (tenants: a quarter)")
    g.add_argument("--adapter-count", type=int, default=1000)
    g.add_argument("--zipf-s", type=float, default=1.0, help="adapter popularity exponent")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--rates", type=float, nargs="+", help="arrival rates (default: a grid "
                   "from the fleet's capacity)")
    g.add_argument("--duration-s", type=float, default=20.0, help="arrivals per run, s")
    g.add_argument("--warmup-s", type=float, default=5.0,
                   help="requests arriving before this are not measured")
    g.add_argument("--slo-ttft-s", type=float)
    g.add_argument("--slo-tpot-s", type=float)
    g.add_argument("--small", action="store_true", help="2 replicas, 8 adapters (and a "
                   "shorter --router-cost: admission up to 100 queued, no table memory)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--adapter-imbalance-bound", type=int, metavar="N",
                   help="the mesh's router: requests in flight a holder of the adapter may "
                        "carry above the least-loaded replica (default: each replica's "
                        "max_num_seqs, as the router does unless configured)")
    g.add_argument("--newcomer-slots", type=int, nargs="+", default=[1], metavar="K",
                   help="tenants: also run token-fair with K of the fleet's slots kept for "
                        "newcomers, so the busy heavy tenant holds the rest (the router's "
                        "default is 1)")
    g.add_argument("--plots", default="docs/images", help="where the PNGs go")
    g.add_argument("--trust", action="store_true", help="replay this host's real-engine "
                   "benchmark runs (2 replicas, 16 adapters; sessions) on cpu-smollm2-trust, "
                   "its profile of the day they ran (whatever --sim is)")
    g.add_argument("--router-cost", type=int, nargs="*", metavar="N",
                   help="time the replica-routing decision at N replicas (default 8 32 128 "
                   "512 1000)")


if __name__ == "__main__":  # the same as bench.py --sim ...
    import bench
    from serve_app.tools.script_args import run as run_script

    argv = sys.argv[1:]
    if "--sim" not in argv and not any(a.startswith("--sim=") for a in argv):
        argv = ["--sim", "h100-llama3-8b", *argv]  # bench.py --sim's run, this profile
    run_script(lambda: bench.main(argv, bench.build_parser(
        __doc__ + "\nOptions are bench.py's; --sim is h100-llama3-8b when not given.",
        prog="bench_scale.py")))
