"""What one router replica costs per request, on a real mesh (``bench.py --router-throughput``):
the ceiling of requests/s one router replica sustains, for sizing (docs/scale.md).

Starts its own Ray cluster (free ports, 127.0.0.1) and deploys ``--config`` (default
serve_configs/tenants.yaml: tenants, limits and adapters, as in production; the load is a
limited tenant's, its limits lifted above it) with every variant
on the simulated engine at ``time_scale`` 0.01 (an engine that costs ~nothing, so the router,
the proxy and the client have the cores). Sends ``--requests`` streamed chats at
``--concurrency`` (``--max-tokens`` each) and reads the CPU time (user + system, psutil) each
Serve process spent meanwhile: the router replica (``MeshRouter``), the HTTP proxy and the
variant replicas, less what each spends idle (its polls, measured for 10 s first, per
second of the load). CPU seconds per request are what the host's sharing changes least (the
wall-clock is shared with the client on these 2 cores), so the ceiling of one router replica
on one core is 1 / (its CPU s per request).

    python scripts/bench.py --router-throughput [--config serve_configs/tenants.yaml]
        [--requests 600] [--concurrency 32] [--max-tokens 16]
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from bench.host_cpu import cpu_seconds
from bench.loadgen import LoadSpec, run_load, summarize
from bench.servers import start_local_ray
from serve_app.common.serve_configs import load_yaml, on_sim_engine
from serve_app.release.deploy import deploy

#: Seconds the processes' idle CPU is measured for (subtracted from the load's).
IDLE_S = 10.0
#: The demo tenant with limits on tenants.yaml: every request asks the ledger, as a limited
#: tenant's does; the limits are lifted far above the load (:func:`lifted`).
API_KEY, TENANT = "sk-initech-demo", "initech"


def lifted(cfg: dict) -> dict:
    """``cfg`` with :data:`TENANT`'s limits far above any load this host can send."""
    for app in cfg["applications"]:
        for dep in app.get("deployments", []):
            for tenant in (dep.get("user_config") or {}).get("tenants", []):
                if tenant["id"] == TENANT:
                    tenant.update(max_concurrent_requests=100_000,
                                  requests_per_minute=10_000_000,
                                  tokens_per_minute=10_000_000_000)
    return cfg


def serve_processes() -> dict[str, list[int]]:
    """Role -> pids of the live Serve actors (router, proxy, replicas, controller)."""
    from ray.util.state import list_actors

    roles: dict[str, list[int]] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        name = actor.class_name or ""
        role = ("router" if "MeshRouter" in name else "proxy" if "ProxyActor" in name
                else "controller" if "ServeController" in name
                else "replica" if name.startswith("ServeReplica") else None)
        if role and actor.pid:
            roles.setdefault(role, []).append(actor.pid)
    return roles


def run(a) -> None:
    """The benchmark (see the module docstring); ``a``: bench.py's arguments."""
    import ray

    dashboard, http_port, _ = start_local_ray()
    url = f"http://127.0.0.1:{http_port}/v1"
    try:
        cfg = lifted(on_sim_engine(load_yaml(a.config), profile="cpu-smollm2",
                                   time_scale=0.01, start_s=0))
        cfg["http_options"] = {"host": "127.0.0.1", "port": http_port}
        path = Path(tempfile.mkdtemp(prefix="bench-router-")) / "mesh.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        print(f"[bench] serve deploy {a.config} on the simulated engine", flush=True)
        deploy(path, dashboard, log=lambda m: None)
        spec = LoadSpec(base_url=url, model=a.model, requests=a.requests,
                        concurrency=a.concurrency, max_tokens=a.max_tokens, api_key=API_KEY)
        asyncio.run(run_load(LoadSpec(**{**spec.__dict__, "requests": 32})))  # warm up
        roles = serve_processes()
        # what each process spends with no request (polls, metrics), per second, to subtract
        idle0 = {role: cpu_seconds(pids) for role, pids in roles.items()}
        time.sleep(IDLE_S)
        idle = {role: (cpu_seconds(pids) - idle0[role]) / IDLE_S for role, pids in roles.items()}
        before = {role: cpu_seconds(pids) for role, pids in roles.items()}
        t0 = time.monotonic()
        results = asyncio.run(run_load(spec))
        wall = time.monotonic() - t0
        spent = {role: max(0.0, cpu_seconds(pids) - before[role] - idle[role] * wall)
                 for role, pids in roles.items()}
        rss = {role: max(psutil.Process(p).memory_info().rss for p in pids) / 2**20
               for role, pids in roles.items()}
    finally:
        ray.shutdown()
    s = summarize(results, wall)
    n = sum(1 for r in results if r.ok)
    print(f"\n{a.requests} streamed chats at {a.concurrency} in flight, {a.max_tokens} tokens "
          f"each, {a.config} on the simulated engine (time_scale 0.01): {n} answered, "
          f"{s['errors']} errors, {n / wall:.0f} requests/s over {wall:.1f} s on this host "
          f"(client included)")
    for role, seconds in sorted(spent.items()):
        per = seconds / max(1, n) * 1000
        print(f"  {role:>10} ({len(roles[role])} processes): {per:6.2f} ms CPU per request"
              f" -> {1000 / per if per else float('inf'):6.0f} requests/s per core; resident "
              f"memory {rss[role]:.0f} MiB (largest process)")

