"""What cluster-wide tenant limits add to a request (``bench.py --limits``, against a mesh
running serve_configs/tenants.yaml): a router's limiter against each ledger backend (the
running mesh's ``SharedTenantCounts`` actor, a real redis-server started here), asking per
request unbatched, batched, and with budget leases (the default), in one run: time per
request, requests/s, ledger calls and the driver's CPU per request; then TTFT p50 of a
tenant with limits against one without."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from bench.loadgen import LoadSpec
from bench.measure import measure


LIMITED, UNLIMITED = "sk-acme-demo", "sk-mesh-ops-demo"  # tenants.yaml: acme has limits


#: The ways a router's limiter counts, measured side by side: (label, max_batch, leases).
KINDS = (("unbatched", 1, False), ("batched", None, False), ("leased", None, True))


class _CountedCalls:
    """A ledger whose calls are counted (every method the limiter calls is a coroutine)."""

    def __init__(self, ledger) -> None:
        self.ledger, self.backend, self.calls = ledger, ledger.backend, 0

    def __getattr__(self, name):
        method = getattr(self.ledger, name)

        async def counted(*args):
            self.calls += 1
            return await method(*args)
        return counted


def shared_count_latency(concurrency: int, calls: int = 400, max_batch: int | None = None,
                         redis_url: str | None = None, leases: bool = False) -> dict:
    """Time ``TenantLimiter.acquire`` + release against a ledger: the running mesh's actor,
    or the Redis server at ``redis_url``, at ``concurrency`` requests in flight: p50/p95 ms
    per acquire, requests per second (the ceiling of one router's limited requests/s),
    ledger calls per request (asks, settlements, lease renewals) and this driver's CPU per
    request, ms. ``max_batch`` 1 sends each ask in a call of its own (unbatched);
    ``leases`` lets the limiter hold budget leases."""
    import ray

    from serve_app.common.config import Tenant
    from serve_app.tenancy.call_batcher import MAX_BATCH
    from serve_app.tenancy.limits import TenantLimiter
    from serve_app.observability.stats import percentile

    if not ray.is_initialized():
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    # Budgets only: a tenant with max_concurrent_requests is never leased (each request
    # asks the ledger for its slot), so it would measure "batched" under every kind.
    tenant = Tenant(id="bench-limits", api_keys_sha256=["0" * 64],
                    requests_per_minute=10**6, tokens_per_minute=10**9)
    from serve_app.common.config import LedgerConfig
    from serve_app.tenancy.ledger import ledger_for
    config = LedgerConfig(backend="redis", redis_url=redis_url) if redis_url else None
    counted: list[_CountedCalls] = []

    def ledger():
        counted.append(_CountedCalls(ledger_for(config)))
        return counted[-1]
    limiter = TenantLimiter(shared=ledger, max_batch=max_batch or MAX_BATCH, leases=leases)

    async def run() -> tuple[list[float], float, float, int]:
        times: list[float] = []
        left = iter(range(calls))
        await limiter.start()

        async def worker() -> None:
            for _ in left:
                t0 = time.perf_counter()
                request = await limiter.acquire(tenant, 100)
                times.append((time.perf_counter() - t0) * 1000)
                limiter.release(request, 80)
        limiter.release(await limiter.acquire(tenant))  # warm up: look up the actor
        await asyncio.sleep(0.1)
        before = sum(c.calls for c in counted)
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        await asyncio.sleep(0.1)  # the last settlements go out
        return times, wall_s, cpu_s, sum(c.calls for c in counted) - before
    times, wall_s, cpu_s, ledger_calls = asyncio.run(run())
    return {"p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95),
            "per_s": calls / wall_s, "calls_per_request": ledger_calls / calls,
            "cpu_ms_per_request": cpu_s / calls * 1000}


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
                    c, calls=a.limit_calls, max_batch=max_batch, redis_url=url, leases=leases)
                for backend, url in (("actor", None), ("redis", redis_url))
                for kind, max_batch, leases in KINDS}})
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
    print(f"\ncluster-wide tenant limits: {a.limit_calls} requests of a limited tenant per run "
          f"(one router's limiter, in a driver); {a.requests} streamed requests per run, "
          f"max_tokens {a.max_tokens}")
    print(f"{'conc':>4} {'ledger, kind':>16} {'p50':>9} {'p95':>9} {'req/s':>8} "
          f"{'calls/req':>9} {'CPU/req':>10}")
    for r in rows:
        for kind, f in r["shared_count"].items():
            print(f"{r['concurrency']:>4} {kind:>16} {f['p50_ms']:>6.2f} ms {f['p95_ms']:>6.2f} ms "
                  f"{f['per_s']:>8.0f} {f['calls_per_request']:>9.3f} "
                  f"{f['cpu_ms_per_request']:>7.3f} ms")
        for backend in ("actor", "redis"):
            per_s = {kind: r["shared_count"][f"{backend} {kind}"]["per_s"] for kind, *_ in KINDS}
            print(f"concurrency {r['concurrency']}: {backend} requests/s batched/unbatched "
                  f"{per_s['batched'] / per_s['unbatched']:.2f}x, leased/batched "
                  f"{per_s['leased'] / per_s['batched']:.2f}x")
    print(f"{'conc':>4} {'TTFT p50 no limits':>19} {'with limits':>12} {'added':>8}")
    for r in rows:
        t = r["ttft_p50_ms"]
        print(f"{r['concurrency']:>4} {t['unlimited']:>16.1f} ms {t['limited']:>9.1f} ms "
              f"{t['limited'] - t['unlimited']:>+6.1f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                            "limits": rows}, indent=2))
