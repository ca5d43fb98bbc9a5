"""One run of the simulated fleet and its figures (``bench.py --sim``, ``--trust``): a fresh
fleet behind a router, optionally the mesh's admission in front, on the virtual clock; every
figure is simulated and says so with its profile (:func:`sim_label`)."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable

from bench.fleet.fleet import EngineLimits, Fleet, FleetRequest
from bench.fleet.routers import make_router
from bench.fleet.virtual_time import run_virtual
from serve_app.admission.variant_queue import VariantAdmission
from serve_app.observability.stats import percentile
from serve_app.common.sim_profile import SimProfile


def sim_label(profile: SimProfile) -> str:
    """How every simulated figure is labelled: simulated, and on which profile."""
    return f"SIMULATED, profile {profile.name}"


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


def simulate(profile: SimProfile, replicas: int, limits: EngineLimits, router: str | Callable,
             requests: list[FleetRequest], follow_up=None, fairness: str | None = None,
             seed: int = 0, newcomer_slots: int = 1, adapter_imbalance_bound: int | None = None
             ) -> tuple[list[FleetRequest], Fleet]:
    """One run on a fresh fleet (``router``: a name of :data:`~bench.fleet.routers.ROUTERS`
    or a factory ``fleet -> router``; ``fairness``: the mesh's admission in front,
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
