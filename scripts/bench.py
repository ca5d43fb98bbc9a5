#!/usr/bin/env python
"""Benchmark the mesh against vLLM's own OpenAI server on the same model, side by side.

Runs the same streaming chat load (``serve_app.tools.loadgen``) against
  (a) the mesh (must be running: ./scripts/demo.sh [CONFIG]), and
  (b) ``python -m vllm.entrypoints.openai.api_server`` started here with the same model,
      engine args and LoRA adapters as the variant in the Serve config (--config),
alternating, ``--rounds`` times (default 3) for each workload and concurrency, and prints
the medians of tokens/s, TTFT p50/p95, latency p50/p95 and errors, the mesh/direct ratios,
and the tokens/s ratio of every round (its spread says what a difference is worth on a noisy
host). The mesh's engine idles while the direct one runs. vLLM's server runs at nice 15 by
default (``--direct-nice``), as Ray runs every process of the mesh (``RAY_worker_niceness``),
so the client, at nice 0, takes CPU from both sides alike.

Workloads:
  base  every request asks for the base model (the route).
  mix   (--mix) a multi-tenant adapter mix: requests cycle over the tenants' adapters and the
        base model, each with its tenant's key (`route:adapter` on the mesh; the adapter's name
        on vLLM's server, loaded there with --lora-modules). Needs a config whose variant
        declares adapters, e.g. serve_configs/tenants.yaml.

Usage:
  python scripts/bench.py [--config serve_configs/local.yaml] [--concurrency 1 8 32]
                          [--requests 32] [--max-tokens 64] [--mix] [--json FILE]
  python scripts/bench.py --limits [--concurrency 1 8 64] [--limit-calls 2000]
  python scripts/bench.py --sessions 16 [--turns 4] [--prefix-tokens 1500] [--tenants 4]
  python scripts/bench.py --adapters 16 [--max-resident 4]
  python scripts/bench.py --sim h100-llama3-8b [--workloads ...] [--router-cost]
  python scripts/bench.py --router-throughput [--requests 600] [--concurrency 32]

--sim PROFILE simulates the mesh at scale (32 replicas, 1,000 adapters; no Ray, no engine):
the mesh's own replica routing and admission on engines priced by PROFILE, on a virtual
clock, each policy against Serve's default router in one run (scripts/bench_scale.py).

--sessions compares cache-aware replica routing with Serve's default router on a variant of
two replicas, in one run, starting its own Ray cluster (scripts/bench_sessions.py).

--adapters K runs K registered adapters on a variant of two replicas: adapter affinity vs
Serve's default router vs vLLM's own server vs base-only, and a hot adapter from merged
weights, in one run, starting its own Ray cluster (scripts/bench_adapters.py; 48 requests at 8
in flight unless --requests / --concurrency say otherwise).

--limits measures what cluster-wide tenant limits add to a request instead (mesh only, run
against serve_configs/tenants.yaml): (a) the router's asks to each ledger backend
(``TenantLimiter.acquire`` + release from a Ray driver on this node, against the running
mesh's ``SharedTenantCounts`` actor and against a real redis-server the benchmark starts),
p50/p95 ms per ask and asks/s (one router's ceiling of limited requests/s) at each
concurrency, batched (the default) and unbatched (one call per ask) side by side; (b) end to end, TTFT p50 of a
tenant with limits (acme) against one without (ops), the same load run alternately.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_app.common.adapters import load_manifest, resolve_uri  # noqa: E402
from serve_app.common.config import ReplicaConfig, VariantArgs  # noqa: E402
from serve_app.common.deployment_options import replica_environment  # noqa: E402
from serve_app.common.paths import resolve_model_path, resolve_repo_path  # noqa: E402
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment, load_yaml, mesh_parts  # noqa: E402,E501
from serve_app.tools.host_cpu import EngineShare  # noqa: E402
from serve_app.tools.loadgen import LoadSpec, run_load, summarize  # noqa: E402
from serve_app.tools.script_args import ScriptError, run, script_parser  # noqa: E402
from serve_app.tools.servers import ServerDidNotStart, free_port, wait_until_ready  # noqa: E402

#: Demo keys of serve_configs/tenants.yaml: the adapter each tenant owns ("" = base model).
DEMO_MIX = "acme-support=sk-acme-demo,globex-report=sk-globex-demo,=sk-mesh-ops-demo"


def vllm_flags(engine_args: dict) -> list[str]:
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):  # vLLM's config objects take JSON
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def variant_adapters(app: dict) -> dict[str, Path]:
    """The adapters the variant declares (first version of each name): name -> directory."""
    dep = deployment(app, REPLICA_DEPLOYMENT) or {}
    replica = ReplicaConfig.model_validate(dep.get("user_config") or {})
    if not replica.adapters:
        return {}
    registry = load_manifest(resolve_repo_path(replica.adapters_manifest)
                             if replica.adapters_manifest else None)
    out: dict[str, Path] = {}
    for ref in replica.adapters:
        out.setdefault(ref.name, resolve_uri(registry[ref.key].uri))
    return out


def start_direct(config_path: str, variant: str | None, nice: int = 0):
    """Start vLLM's own server like the variant, at niceness ``nice``; returns (process,
    base url, served name, adapters served)."""
    parts = mesh_parts(load_yaml(config_path))
    app = parts.variant(variant)
    name = app["name"]
    args = VariantArgs.model_validate(app.get("args") or {})
    adapters = variant_adapters(app)
    env = {**os.environ, **replica_environment(app)}  # the replica's, threads included
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", resolve_model_path(args.model), "--served-model-name",
           args.served_model_name, "--host", "127.0.0.1", "--port", str(port),
           *vllm_flags(args.engine_args)]
    if adapters:
        cmd += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    print(f"[bench] starting vLLM's own server (same args as {name}): {' '.join(cmd[2:])}",
          flush=True)
    log = open("/tmp/bench-vllm-direct.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, f"{url}/health", what="vLLM's server",
                         log_path="/tmp/bench-vllm-direct.log", timeout_s=300, every_s=2)
    except ServerDidNotStart as e:
        sys.exit(f"[bench] {e}")
    return proc, f"{url}/v1", args.served_model_name, set(adapters)


def start_direct_ingress_mesh(config_path: str) -> dict[str, str]:
    """A new local cluster with direct ingress on and ``config_path`` deployed on it: the
    mesh's base URL through the Serve proxy (``mesh``) and through the router replica's own
    HTTP port (``direct-ingress``). The cluster lives until this process exits."""
    import psutil
    import yaml

    from serve_app.release.deploy import deploy, running_replicas
    from serve_app.tools.servers import start_local_ray

    dashboard, http_port, _ = start_local_ray({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"})
    cfg = load_yaml(config_path)
    cfg["http_options"] = {"host": "127.0.0.1", "port": http_port}
    path = Path(".mesh/bench/bench-direct-ingress.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print("[bench] direct ingress: a new cluster, serve deploy (the engine starts)", flush=True)
    deploy(path, dashboard, log=lambda m: None)
    [router] = running_replicas(dashboard, "mesh", "MeshRouter")
    # Serve gives each ingress replica an HTTP port from RAY_SERVE_DIRECT_INGRESS_MIN/MAX_
    # HTTP_PORT (30000-31000) and does not publish it: read it off the replica's sockets.
    ports = sorted(c.laddr.port for c in psutil.Process(router["pid"]).net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and 30000 <= c.laddr.port < 31000)
    if not ports:
        sys.exit("[bench] the router replica listens on no direct-ingress port")
    targets = {"mesh": f"http://127.0.0.1:{http_port}/v1",
               "direct-ingress": f"http://127.0.0.1:{ports[0]}/v1"}
    for name, url in targets.items():  # what a client sees each way
        r = httpx.get(f"{url[:-3]}/health", timeout=30)
        print(f"[bench] {name} ({url}): GET /health {r.status_code}, x-request-id "
              f"{'present' if 'x-request-id' in r.headers else 'ABSENT'}", flush=True)
    return targets


def measure(label: str, spec: LoadSpec) -> dict:
    """``spec``'s load after a warm-up of one request per slot: :func:`summarize`'s figures,
    and ``worker_cores`` / ``busy_engines``: the cores each busy vLLM engine's workers got
    meanwhile and how many were busy (:class:`~serve_app.tools.host_cpu.EngineShare`;
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


def parse_mix(text: str, route: str, served: set[str]) -> list[tuple[str, str, str]]:
    """``adapter=key,...`` -> (mesh model, direct model, key) per entry ("" = base)."""
    out = []
    for item in text.split(","):
        adapter, _, key = item.partition("=")
        if adapter and adapter not in served:
            sys.exit(f"[bench] --mix names {adapter!r}, which the variant does not declare "
                     f"(it declares: {', '.join(sorted(served)) or 'none'})")
        out.append((f"{route}:{adapter}" if adapter else route, adapter or route, key))
    return out


def median_of(runs: list[dict]) -> dict:
    """Each figure's median over the rounds of one row."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def ratios(mesh: dict, direct: dict) -> dict:
    return {k: mesh[k] / direct[k] if direct[k] else float("nan")
            for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "latency_p50_ms",
                      "latency_p95_ms")}


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


def bench_limits(a) -> None:
    import tempfile

    from serve_app.tools.servers import start_redis
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


def build_parser(description: str | None = __doc__, prog: str | None = None):
    """bench.py's options (also those of bench_sessions.py and bench_adapters.py)."""
    parser = script_parser(description, prog=prog)
    parser.add_argument("--mesh-url", default="http://127.0.0.1:8000/v1",
                        help="the running mesh's OpenAI base URL")
    parser.add_argument("--config", default="serve_configs/local.yaml",
                        help="the Serve config the mesh runs (its variant's model and engine "
                        "args start vLLM's own server)")
    parser.add_argument("--variant", help="variant application to mirror (default: the "
                        "config's first)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                        help="requests in flight, one row each (--adapters: the first, 8 "
                        "when not given)")
    parser.add_argument("--requests", type=int,
                        help="requests per round (default 32; --adapters: 48; "
                        "--router-throughput: 600)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="direct and mesh alternate this many times per row; the row "
                        "shows each figure's median and the spread of the tokens/s ratio")
    parser.add_argument("--direct-nice", type=int, default=15,
                        help="niceness of vLLM's own server: 15, as Ray runs the mesh's "
                        "processes (RAY_worker_niceness), so both share the CPU alike with "
                        "the client; 0 to compare with vLLM as it runs by default")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="max_tokens of each request (ignore_eos: each generates them all)")
    parser.add_argument("--api-key", default="sk-mesh-ops-demo",
                        help="key for the base workload (ignored by a mesh in open mode)")
    parser.add_argument("--mix", nargs="?", const=DEMO_MIX, metavar="ADAPTER=KEY,...",
                        help=f"also run the adapter mix (default: {DEMO_MIX})")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="start its own cluster with Ray Serve's direct ingress on "
                        "(RAY_SERVE_ENABLE_DIRECT_INGRESS=1), deploy --config, and measure "
                        "the mesh through the Serve proxy and straight to the router "
                        "replica's own port in the same rounds")
    parser.add_argument("--limits", action="store_true",
                        help="measure what cluster-wide tenant limits add (see above)")
    parser.add_argument("--limit-calls", type=int, default=2000,
                        help="--limits: asks to the shared counts per run")
    parser.add_argument("--sessions", type=int, metavar="N",
                        help="cache-aware replica routing vs Serve's default router on two "
                        "replicas (scripts/bench_sessions.py; starts its own Ray and mesh)")
    parser.add_argument("--turns", type=int, default=4, help="--sessions: turns per session")
    parser.add_argument("--prefix-tokens", type=int, default=1500,
                        help="--sessions: system prompt + document tokens per session")
    parser.add_argument("--in-flight", type=int, default=0,
                        help="--sessions: requests in flight at once (default: every session)")
    parser.add_argument("--tenants", type=int, default=4,
                        help="--sessions: tenants (one system prompt each)")
    parser.add_argument("--workdir", default=".mesh/bench",
                        help="--sessions: where the deployed configs are written")
    parser.add_argument("--adapters", type=int, metavar="K",
                        help="many LoRA adapters: K registered copies on a 2-replica variant, "
                        "adapter affinity vs Serve's default router vs vLLM direct vs "
                        "base-only, and a merged variant (scripts/bench_adapters.py; starts "
                        "its own Ray and mesh)")
    parser.add_argument("--max-resident", type=int, default=4,
                        help="--adapters: max_adapters_per_replica")
    parser.add_argument("--router-throughput", action="store_true",
                        help="CPU per request of the router replica, the proxy and the "
                        "replicas on a real mesh of simulated engines (scripts/bench_router.py;"
                        " starts its own Ray and mesh; --config default tenants.yaml)")
    parser.add_argument("--model", default="smollm", help="--router-throughput: the route")
    import bench_scale  # scripts/: --sim's options

    bench_scale.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, parser=None) -> None:
    a = (parser or build_parser()).parse_args(argv)
    if a.sim:
        import bench_scale

        return bench_scale.run(a)
    if a.router_throughput:
        import bench_router

        if a.config == "serve_configs/local.yaml":  # the default of the other modes
            a.config = "serve_configs/tenants.yaml"
        a.requests = a.requests or 600
        a.concurrency = a.concurrency[0] if a.concurrency != [1, 8, 32] else 32
        a.max_tokens = a.max_tokens if a.max_tokens != 64 else 16
        return bench_router.run(a)
    if not Path(a.config).is_file():
        raise ScriptError(f"--config {a.config}: no such file")
    if a.adapters:
        import bench_adapters
        a.requests = a.requests or 48
        a.concurrency = a.concurrency[0] if a.concurrency != [1, 8, 32] else 8
        return bench_adapters.run(a)
    if a.sessions:
        import bench_sessions

        return bench_sessions.run(a)
    a.requests = a.requests or 32

    targets = {"mesh": a.mesh_url}
    if a.direct_ingress:  # its own cluster: both ways into the same mesh, one run
        targets = start_direct_ingress_mesh(a.config)
        a.mesh_url = targets["mesh"]
    try:
        httpx.get(a.mesh_url + "/models", timeout=5,
                  headers={"authorization": f"Bearer {a.api_key}"}).raise_for_status()
    except httpx.HTTPError as e:
        raise ScriptError(f"the mesh is not answering at {a.mesh_url} ({e}); start it with "
                          "./scripts/demo.sh, or pass its address with --mesh-url") from None
    if a.limits:
        return bench_limits(a)

    proc, direct_url, route, served = start_direct(a.config, a.variant, a.direct_nice)
    workloads = {"base": [(route, route, a.api_key)]}
    if a.mix:
        workloads["mix"] = parse_mix(a.mix, route, served)
    rows = []
    try:
        for workload, entries in workloads.items():
            for c in a.concurrency:
                common = dict(requests=a.requests, concurrency=c, max_tokens=a.max_tokens)
                runs: dict[str, list[dict]] = {name: [] for name in targets}
                directs = []
                for i in range(a.rounds):  # alternate, so a noisy minute hits both sides
                    directs.append(measure(f"direct {workload} {i + 1}/{a.rounds}", LoadSpec(
                        base_url=direct_url, model=route, mix=tuple(
                            (d, "none") for _, d, _ in entries), **common)))
                    for name, url in targets.items():
                        runs[name].append(measure(f"{name} {workload} {i + 1}/{a.rounds}",
                                                  LoadSpec(base_url=url, model=route,
                                                           mix=tuple((m, k) for m, _, k
                                                                     in entries), **common)))
                direct = median_of(directs)
                for name, meshes in runs.items():
                    per_round = [m["tokens_per_s"] / d["tokens_per_s"] if d["tokens_per_s"]
                                 else float("nan") for m, d in zip(meshes, directs)]
                    mesh = median_of(meshes)
                    rows.append({"workload": workload, "concurrency": c, "target": name,
                                 "mesh": mesh, "direct": direct, "ratio": ratios(mesh, direct),
                                 "tokens_ratio_rounds": per_round})
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    print(f"\nstreaming chat, {a.requests} requests per round, {a.rounds} rounds per row "
          f"(medians), max_tokens {a.max_tokens} (ignore_eos), config {a.config}; vLLM's "
          f"server at nice {a.direct_nice}, the mesh's processes at Ray's")
    print(f"{'workload':>8} {'conc':>4} {'target':>6} {'tok/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p95':>9} {'lat p50':>8} {'lat p95':>8} {'errors':>6}")
    for r in rows:
        for label in ("mesh", "direct"):
            s = r[label]
            print(f"{r['workload']:>8} {r['concurrency']:>4} "
                  f"{r['target'] if label == 'mesh' else label:>6} "
                  f"{s['tokens_per_s']:>7.1f} {s['ttft_p50_ms']:>7.0f}ms "
                  f"{s['ttft_p95_ms']:>7.0f}ms {s['latency_p50_ms']:>6.0f}ms "
                  f"{s['latency_p95_ms']:>6.0f}ms {s['errors']:>6}")
        q = r["ratio"]
        print(f"{r['workload']:>8} {r['concurrency']:>4} {'ratio':>6} {q['tokens_per_s']:>7.2f} "
              f"{q['ttft_p50_ms']:>9.2f} {q['ttft_p95_ms']:>9.2f} {q['latency_p50_ms']:>8.2f} "
              f"{q['latency_p95_ms']:>8.2f}   TTFT p50 overhead "
              f"{r['mesh']['ttft_p50_ms'] - r['direct']['ttft_p50_ms']:+.0f} ms")
        rr = r["tokens_ratio_rounds"]
        print(f"{r['workload']:>8} {r['concurrency']:>4} {r['target']}/direct tok/s median "
              f"{statistics.median(rr):.2f} (rounds: {', '.join(f'{x:.2f}' for x in rr)})")
    if "mix" in workloads:
        base = {r["concurrency"]: r for r in rows if r["workload"] == "base"
                and r["target"] == "mesh"}
        for r in (r for r in rows if r["workload"] == "mix" and r["target"] == "mesh"):
            b = base[r["concurrency"]]
            print(f"mix/base tok/s at c={r['concurrency']}: mesh "
                  f"{r['mesh']['tokens_per_s'] / b['mesh']['tokens_per_s']:.2f}, direct "
                  f"{r['direct']['tokens_per_s'] / b['direct']['tokens_per_s']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "host": f"{platform.node()} "
            f"({os.cpu_count()} CPUs)", "config": a.config, "requests": a.requests,
            "max_tokens": a.max_tokens, "rows": rows}, indent=2))
        print(f"[bench] figures written to {a.json}")


if __name__ == "__main__":
    run(main)
