#!/usr/bin/env python
"""Benchmark the mesh against vLLM's own OpenAI server on the same model, side by side.

Runs the same streaming chat load (``serve_app.loadgen``) against
  (a) the mesh (must be running: ./scripts/demo.sh), and
  (b) ``python -m vllm.entrypoints.openai.api_server`` started here with the same model and
      engine args as the variant in the Serve config (read from --config),
one after the other for each concurrency, and prints tokens/s, TTFT p50/p95, latency p50/p95,
errors, and the mesh/direct ratios. The mesh's engine idles while the direct one runs.

Usage: python scripts/bench.py [--concurrency 1 8] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_app.common.config import VariantArgs  # noqa: E402
from serve_app.tools.loadgen import LoadSpec, run_load, summarize  # noqa: E402
from serve_app.common.paths import resolve_model_path  # noqa: E402
from serve_app.common.serve_configs import load_yaml, mesh_parts  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def start_direct(config_path: str, variant: str | None) -> tuple[subprocess.Popen, str, str]:
    parts = mesh_parts(load_yaml(config_path))
    name = variant or next(iter(parts.variant_apps))
    app = parts.variant_apps[name]
    args = VariantArgs.model_validate(app.get("args") or {})
    env = {**os.environ, **(app.get("runtime_env", {}).get("env_vars") or {})}
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", resolve_model_path(args.model), "--served-model-name",
           args.served_model_name, "--host", "127.0.0.1", "--port", str(port),
           *vllm_flags(args.engine_args)]
    print(f"[bench] starting vLLM's own server (same args as {name}): {' '.join(cmd[2:])}",
          flush=True)
    log = open("/tmp/bench-vllm-direct.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            sys.exit("[bench] vLLM server exited; see /tmp/bench-vllm-direct.log")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit("[bench] vLLM server did not become healthy in 300 s")
        time.sleep(2)
    return proc, f"{url}/v1", args.served_model_name


def measure(label: str, base_url: str, model: str, concurrency: int, a) -> dict:
    spec = LoadSpec(base_url=base_url, model=model, requests=a.requests,
                    concurrency=concurrency, max_tokens=a.max_tokens)
    asyncio.run(run_load(LoadSpec(**{**spec.__dict__, "requests": concurrency})))  # warm-up
    t0 = time.monotonic()
    results = asyncio.run(run_load(spec))
    s = summarize(results, time.monotonic() - t0)
    print(f"[bench] {label:6s} c={concurrency}: {s['tokens_per_s']:.1f} tok/s, "
          f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, latency p50 {s['latency_p50_ms']:.0f} ms, "
          f"errors {s['errors']}", flush=True)
    return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--config", default="serve_configs/local.yaml")
    parser.add_argument("--variant", help="variant application to mirror (default: first)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    a = parser.parse_args()

    try:
        httpx.get(a.mesh_url + "/models", timeout=5).raise_for_status()
    except httpx.HTTPError as e:
        sys.exit(f"[bench] the mesh is not answering at {a.mesh_url} ({e}); "
                 "start it with ./scripts/demo.sh")

    proc, direct_url, model = start_direct(a.config, a.variant)
    rows = []
    try:
        for c in a.concurrency:
            direct = measure("direct", direct_url, model, c, a)
            mesh = measure("mesh", a.mesh_url, model, c, a)
            rows.append((c, mesh, direct))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    print(f"\nstreaming chat, {a.requests} requests, max_tokens {a.max_tokens} (ignore_eos)")
    head = (f"{'conc':>4} {'target':>6} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p95':>9} "
            f"{'lat p50':>8} {'lat p95':>8} {'errors':>6}")
    print(head)
    for c, mesh, direct in rows:
        for label, s in (("mesh", mesh), ("direct", direct)):
            print(f"{c:>4} {label:>6} {s['tokens_per_s']:>7.1f} {s['ttft_p50_ms']:>7.0f}ms "
                  f"{s['ttft_p95_ms']:>7.0f}ms {s['latency_p50_ms']:>6.0f}ms "
                  f"{s['latency_p95_ms']:>6.0f}ms {s['errors']:>6}")
        print(f"{c:>4} {'ratio':>6} {mesh['tokens_per_s'] / direct['tokens_per_s']:>7.2f} "
              f"{mesh['ttft_p50_ms'] / direct['ttft_p50_ms']:>9.2f} "
              f"{mesh['ttft_p95_ms'] / direct['ttft_p95_ms']:>9.2f} "
              f"{mesh['latency_p50_ms'] / direct['latency_p50_ms']:>8.2f} "
              f"{mesh['latency_p95_ms'] / direct['latency_p95_ms']:>8.2f}")


if __name__ == "__main__":
    main()
