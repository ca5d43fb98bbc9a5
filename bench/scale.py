"""The mesh at scale, by simulation (``bench.py --sim PROFILE``): the replica-routing and
admission policies measured on a fleet of simulated engines (:mod:`bench.fleet.fleet`:
the mesh's own routing and admission code, engines priced by a profile, on a virtual clock),
against the same fleet without the feature, in one run. Every figure it prints is simulated
and says its profile.

Workloads (seeded; :mod:`bench.fleet.workloads`), open-loop Poisson arrivals:

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

import json
import math
import statistics
import time
from pathlib import Path

from bench.fleet.fleet import EngineLimits, FleetRequest
from bench.fleet.runs import sim_label, simulate, summarize, tokens_per_s
from bench.fleet.workloads import (MAX_TOKENS, PROMPT_TOKENS, Sessions, adapter_rank,
                                   many_adapters, reachable_hit_rate, tenants)
from bench.router_cost import admission_cost, affinity_table_memory, router_cost
from bench.scale_plots import plot
from bench.trust import trust
from serve_app.observability.stats import percentile
from serve_app.common.sim_profile import SimProfile, load_profile

#: SLOs by profile when none is given: (TTFT p95 s, TPOT p95 s). The GPU one is a common
#: interactive target for an 8B chat model; the CPU one scales it to a 135M model on 2 cores.
DEFAULT_SLO = {"h100-llama3-8b": (1.0, 0.05), "cpu-smollm2": (10.0, 0.5)}
#: ``--sim`` given without a profile: the one docs/scale.md's results are of.
DEFAULT_SIM_PROFILE = "h100-llama3-8b"
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
    print(f"\n[{sim_label(profile)}] many-adapters: {a.adapter_count} adapters (Zipf s="
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
    print(f"\n[{sim_label(profile)}] sessions: {a.replicas} replicas, conversations of 3-8 "
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
    print(f"\n[{sim_label(profile)}] tenants: {replicas} replicas, heavy tenant at {heavy:.0f}/s "
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
    print(f"[bench --sim] {sim_label(profile)}: {profile.description}\n  source: "
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


def _without(value, key: str):
    if isinstance(value, dict):
        return {k: _without(v, key) for k, v in value.items() if k != key}
    return [_without(v, key) for v in value] if isinstance(value, list) else value


def add_arguments(parser) -> None:
    """``bench.py --sim``'s options."""
    g = parser.add_argument_group("--sim PROFILE (the mesh at scale, simulated)")
    g.add_argument("--sim", nargs="?", const=DEFAULT_SIM_PROFILE, metavar="PROFILE",
                   help="simulate a fleet of engines of this profile (serve_app/sim/profiles; "
                        f"{DEFAULT_SIM_PROFILE} when PROFILE is not given)")
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
