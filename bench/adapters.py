"""Many LoRA adapters on a 2-replica variant: adapter affinity against Serve's default router,
vLLM's own server and the base model, and a hot adapter from merged weights, in one run
(``bench.py --adapters K``).

Starts its own Ray cluster (free ports, 127.0.0.1). Registers ``K`` copies of the demo
adapters in a temporary registry (``bench.adapter_copies``; never in ``adapters/``),
declares them all on serve_configs/affinity.yaml's two replicas with at most
``--max-resident`` resident on each, and sends the same load to each set-up with the real
``serve deploy`` between (and ``serve shutdown``, so the router's handle is made anew):

1. ``affinity``: the mesh's AffinityRouter (adapter affinity; a cold adapter to the least-loaded
   replica with a LoRA batch slot);
2. ``default``: Serve's power-of-two-choices (no ``request_router_config``), then
   ``base-only``: the same load on the base model, same mesh;
3. ``merged``: serve_configs/merged.yaml: ``smollm:acme-support`` from smollm-acme's merged
   weights, and ``base-only`` on the same mesh;
4. ``direct``: vLLM's own server, one engine with smollm-v1's engine args and the K adapters
   as ``--lora-modules`` (after Ray is stopped), cycling over them, then base-only.

The load: ``--requests`` streamed chats, ``--concurrency`` at a time, request ``i`` for adapter
``i % K`` (``ignore_eos``, ``--max-tokens`` each). Prints a table and each ratio on its own
line (``K=16 affinity/default tokens/s 1.62x``).

    python scripts/bench.py --adapters 16 [--max-resident 4] [--requests 48] [--concurrency 8]
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

from bench.adapter_copies import register_copies
from bench.direct_vllm import start_direct
from bench.loadgen import LoadSpec
from bench.measure import measure
from bench.servers import start_local_ray
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.release.deploy import deploy

OPS_KEY, ACME_KEY = "sk-mesh-ops-demo", "sk-acme-demo"  # merged.yaml's demo tenants


def copies_config(names: list[str], manifest: Path, max_resident: int, http_port: int
                  ) -> dict:
    cfg = load_yaml(REPO_ROOT / "serve_configs" / "affinity.yaml")
    cfg["http_options"] = {"host": "127.0.0.1", "port": http_port}
    cfg["applications"][1]["deployments"][0]["user_config"] = {
        "adapters": [{"name": n, "version": 1} for n in names],
        "adapters_manifest": str(manifest), "max_adapters_per_replica": max_resident}
    return cfg


def run(a) -> None:
    """The whole benchmark (see the module docstring); ``a``: bench.py's arguments."""
    import ray
    from ray import serve

    work = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    manifest, names = register_copies(a.adapters, work / "registry")
    dashboard, http_port, _ = start_local_ray()
    url = f"http://127.0.0.1:{http_port}/v1"
    cycling = LoadSpec(base_url=url, model="smollm", requests=a.requests,
                       concurrency=a.concurrency, max_tokens=a.max_tokens,
                       mix=tuple((f"smollm:{n}", "none") for n in names))
    base_only = replace(cycling, mix=())
    rows: dict[str, dict] = {}

    def deployed(name: str, cfg: dict) -> None:
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        print(f"[bench] {name}: serve deploy", flush=True)
        deploy(path, dashboard, log=lambda m: None)

    try:
        for setup in ("affinity", "default"):
            cfg = copies_config(names, manifest, a.max_resident, http_port)
            if setup == "default":
                cfg["applications"][1]["deployments"][0].pop("request_router_config")
            deployed(setup, cfg)
            rows[setup] = measure(f"{setup} K={a.adapters}", cycling)
            if setup == "default":
                rows["base-only"] = measure("base-only", base_only)
            serve.shutdown()
        merged = load_yaml(REPO_ROOT / "serve_configs" / "merged.yaml")
        merged["http_options"] = {"host": "127.0.0.1", "port": http_port}
        deployed("merged", merged)
        rows["merged"] = measure("merged acme-support", replace(
            base_only, model="smollm:acme-support", api_key=ACME_KEY))
        rows["merged base-only"] = measure("base-only", replace(base_only,
                                                                      api_key=OPS_KEY))
        serve.shutdown()
    finally:
        ray.shutdown()
    config_path = work / "affinity.yaml"
    proc, direct_url, route, served = start_direct(str(config_path), "smollm-v1",
                                                         a.direct_nice)
    try:
        direct = LoadSpec(base_url=direct_url, model=route, requests=a.requests,
                          concurrency=a.concurrency, max_tokens=a.max_tokens)
        rows["direct"] = measure(f"direct K={a.adapters}", replace(
            direct, mix=tuple((n, "none") for n in names)))
        rows["direct base-only"] = measure("direct base", direct)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    report(a, rows)


def report(a, rows: dict[str, dict]) -> None:
    k = a.adapters
    print(f"\nK={k} registered adapters on 2 replicas, at most {a.max_resident} resident per "
          f"replica (max_loras 2); {a.requests} requests at {a.concurrency} in flight, "
          f"{a.max_tokens} tokens each, request i for adapter i % K")
    print("| set-up | tokens/s | TTFT p50 ms | TTFT p95 ms | errors | "
          "busy engines x worker cores each |")
    print("|---|---|---|---|---|---|")
    labels = {"affinity": f"mesh, adapter affinity, K={k}", "default":
              f"mesh, Serve's default router, K={k}", "base-only": "mesh, base model only",
              "merged": "mesh, acme-support from its merged variant",
              "merged base-only": "same mesh, base model only",
              "direct": f"vLLM's own server (1 engine), K={k}",
              "direct base-only": "vLLM's own server, base model only"}
    for key, label in labels.items():
        r = rows[key]
        print(f"| {label} | {r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_p95_ms']:.0f} | {r['errors']} | {r['engines']} |")
    print()
    for num, den, what in (("affinity", "default", "affinity/default"),
                           ("affinity", "base-only", "affinity/base-only"),
                           ("default", "base-only", "default/base-only"),
                           ("direct", "direct base-only", "direct/direct-base-only")):
        print(f"K={k} {what} tokens/s "
              f"{rows[num]['tokens_per_s'] / rows[den]['tokens_per_s']:.2f}x")
    print(f"merged/base-only tokens/s "
          f"{rows['merged']['tokens_per_s'] / rows['merged base-only']['tokens_per_s']:.2f}x")
    print(f"errors: {sum(r['errors'] for r in rows.values())}")

