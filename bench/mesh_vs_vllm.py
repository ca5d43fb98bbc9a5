"""The mesh against vLLM's own OpenAI server on the same model, side by side (``bench.py``'s
default run; ``scripts/bench.py`` describes the workloads and the table it prints)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.direct_vllm import start_direct
from bench.loadgen import LoadSpec
from bench.measure import measure
from bench.script_args import ScriptError
from serve_app.common.serve_configs import load_yaml

#: Demo keys of serve_configs/tenants.yaml: the adapter each tenant owns ("" = base model).
DEMO_MIX = "acme-support=sk-acme-demo,globex-report=sk-globex-demo,=sk-mesh-ops-demo"


def start_direct_ingress_mesh(config_path: str) -> dict[str, str]:
    """A new local cluster with direct ingress on and ``config_path`` deployed on it: the
    mesh's base URL through the Serve proxy (``mesh``) and through the router replica's own
    HTTP port (``direct-ingress``). The cluster lives until this process exits."""
    import psutil
    import yaml

    from serve_app.release.deploy import deploy, running_replicas
    from bench.servers import start_local_ray

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


def mesh_targets(a) -> dict[str, str]:
    """Name -> OpenAI base URL of each way into the mesh to measure: ``--mesh-url`` (the
    running mesh), or with ``--direct-ingress`` a new cluster's proxy and router replica.

    Raises:
        ScriptError: the mesh does not answer ``GET /models``.
    """
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
    return targets


def run(a, targets: dict[str, str]) -> None:
    """The benchmark: every workload and concurrency, ``--rounds`` times alternately on vLLM's
    own server and on each of ``targets``; prints the table (``a``: bench.py's arguments)."""
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
