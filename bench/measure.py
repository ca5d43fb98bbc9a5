"""One measured load of a benchmark: a warm-up, then the load with the host's CPU shares of the
busy engines recorded beside its figures."""

from __future__ import annotations

import asyncio
import time

from bench.host_cpu import EngineShare
from bench.loadgen import LoadSpec, run_load, summarize


def measure(label: str, spec: LoadSpec) -> dict:
    """``spec``'s load after a warm-up of one request per slot: :func:`summarize`'s figures,
    and ``worker_cores`` / ``busy_engines``: the cores each busy vLLM engine's workers got
    meanwhile and how many were busy (:class:`~bench.host_cpu.EngineShare`;
    ``engines``: the two as the tables show them)."""
    asyncio.run(run_load(LoadSpec(**{**spec.__dict__, "requests": spec.concurrency})))  # warm
    with EngineShare() as share:
        t0 = time.monotonic()
        results = asyncio.run(run_load(spec))
        wall = time.monotonic() - t0
    s = summarize(results, wall)
    s.update(share.figures())
    print(f"[bench] {label:12s} c={spec.concurrency}: {s['tokens_per_s']:.1f} tok/s, "
          f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, latency p50 {s['latency_p50_ms']:.0f} ms, "
          f"errors {s['errors']}; busy engines x worker cores {share}", flush=True)
    return s
