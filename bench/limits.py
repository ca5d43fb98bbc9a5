"""What cluster-wide tenant limits add to a request (``bench.py --limits``, against a mesh
running serve_configs/tenants.yaml): the router's asks to each ledger backend (the running
mesh's ``SharedTenantCounts`` actor, a real redis-server started here), batched and not, and
TTFT p50 of a tenant with limits against one without."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from bench.loadgen import LoadSpec
from bench.measure import measure


LIMITED, UNLIMITED = "sk-acme-demo", "sk-mesh-ops-demo"  # tenants.yaml: acme has limits


def shared_count_latency(concurrency: int, calls: int = 400, max_batch: int | None = None,
                         redis_url: str | None = None) -> dict:
    """Time ``TenantLimiter.acquire`` + release against a ledger: the running mesh's actor,
    or the Redis server at ``redis_url``: p50/p95 ms per ask, and asks per second (the
    ceiling of one router's limited requests/s), at ``concurrency`` asks in flight.
    ``max_batch`` 1 sends each ask in a call of its own (unbatched)."""
    import ray

    from serve_app.common.config import Tenant
    from serve_app.tenancy.call_batcher import MAX_BATCH
    from serve_app.tenancy.limits import TenantLimiter
    from serve_app.observability.stats import percentile

    if not ray.is_initialized():
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    tenant = Tenant(id="bench-limits", api_keys_sha256=["0" * 64],
                    max_concurrent_requests=10**6, tokens_per_minute=10**9)
    from serve_app.common.config import LedgerConfig
    from serve_app.tenancy.ledger import ledger_for
    config = LedgerConfig(backend="redis", redis_url=redis_url) if redis_url else None
    limiter = TenantLimiter(shared=lambda: ledger_for(config), max_batch=max_batch or MAX_BATCH)

    async def run() -> tuple[list[float], float]:
        times: list[float] = []
        left = iter(range(calls))

        async def worker() -> None:
            for _ in left:
                t0 = time.perf_counter()
                lease = await limiter.acquire(tenant, 100)
                times.append((time.perf_counter() - t0) * 1000)
                limiter.release(lease, 80)
        limiter.release(await limiter.acquire(tenant))  # warm up: look up the actor
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return times, time.perf_counter() - t0
    times, wall_s = asyncio.run(run())
    return {"p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95),
            "per_s": calls / wall_s}


def run(a) -> None:
    """``bench.py --limits``: the ledger asks of every backend at each concurrency, then
    TTFT p50 with limits and without on the running mesh; prints the tables."""
    import tempfile

    from bench.servers import start_redis

    redis_dir = tempfile.mkdtemp(prefix="bench-ledger-")
    redis_proc, redis_url = start_redis(redis_dir)  # a real server, appendonly as shipped
    rows = []
    try:
        for c in a.concurrency:
            rows.append({"concurrency": c, "shared_count": {
                f"{backend} {kind}": shared_count_latency(
                    c, calls=a.limit_calls, max_batch=1 if kind == "unbatched" else None,
                    redis_url=url)
                for backend, url in (("actor", None), ("redis", redis_url))
                for kind in ("unbatched", "batched")}})
    finally:
        redis_proc.kill()
    for r in rows:
        c = r["concurrency"]
        common = dict(base_url=a.mesh_url, model="smollm", requests=a.requests,
                      concurrency=c, max_tokens=a.max_tokens)
        runs = {"limited": [], "unlimited": []}
        for _ in range(2):  # alternate, so drift on this shared host hits both alike
            runs["unlimited"].append(measure("no limits", LoadSpec(api_key=UNLIMITED, **common)))
            runs["limited"].append(measure("with limits", LoadSpec(api_key=LIMITED, **common)))
        r["ttft_p50_ms"] = {k: sum(x["ttft_p50_ms"] for x in v) / len(v)
                            for k, v in runs.items()}
    print(f"\ncluster-wide tenant limits: {a.limit_calls} asks to the shared counts per run "
          f"(one router's driver); {a.requests} streamed requests per run, max_tokens "
          f"{a.max_tokens}")
    print(f"{'conc':>4} {'ledger, asks':>16} {'p50':>9} {'p95':>9} {'asks/s':>8}")
    for r in rows:
        for kind, f in r["shared_count"].items():
            print(f"{r['concurrency']:>4} {kind:>16} {f['p50_ms']:>6.2f} ms {f['p95_ms']:>6.2f} ms "
                  f"{f['per_s']:>8.0f}")
        for backend in ("actor", "redis"):
            counts = r["shared_count"]
            ratio = counts[f"{backend} batched"]["per_s"] / counts[f"{backend} unbatched"]["per_s"]
            print(f"concurrency {r['concurrency']}: {backend} batched/unbatched asks/s "
                  f"{ratio:.2f}x")
    print(f"{'conc':>4} {'TTFT p50 no limits':>19} {'with limits':>12} {'added':>8}")
    for r in rows:
        t = r["ttft_p50_ms"]
        print(f"{r['concurrency']:>4} {t['unlimited']:>16.1f} ms {t['limited']:>9.1f} ms "
              f"{t['limited'] - t['unlimited']:>+6.1f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                            "limits": rows}, indent=2))
