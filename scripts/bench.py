#!/usr/bin/env python
"""Benchmark the mesh against vLLM's own OpenAI server on the same model, side by side.

Runs the same streaming chat load (``bench.loadgen``) against
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
  python scripts/bench.py --sessions [N] [--turns 4] [--prefix-tokens 1500] [--tenants 4]
  python scripts/bench.py --adapters [K] [--max-resident 4]
  python scripts/bench.py --sim [PROFILE] [--workloads ...] [--router-cost]
  python scripts/bench.py --router-throughput [--ingress proxy|haproxy|both] [--requests 600]
                          [--concurrency 32] [--ttft-requests 100] [--profile] [--json FILE]

--sim PROFILE simulates the mesh at scale (32 replicas, 1,000 adapters; no Ray, no engine):
the mesh's own replica routing and admission on engines priced by PROFILE (h100-llama3-8b
when not given), on a virtual clock, each policy against Serve's default router in one run
(bench/scale.py).

--sessions N compares cache-aware replica routing with Serve's default router on a variant of
two replicas, N sessions (24 when not given), in one run, starting its own Ray cluster
(bench/sessions.py).

--adapters K runs K registered adapters (16 when not given) on a variant of two replicas:
adapter affinity vs Serve's default router vs vLLM's own server vs base-only, and a hot
adapter from merged weights, in one run, starting its own Ray cluster (bench/adapters.py; 48
requests at 8 in flight unless --requests / --concurrency say otherwise).

--router-throughput measures what the mesh adds per request against vLLM's own OpenAI server
on the same simulated engine, in one run: requests/s at saturation, TTFT overhead at one in
flight, and the CPU of every process the mesh adds (bench/router_throughput.py; starts its own
Ray and mesh, one per ingress).

--limits measures what cluster-wide tenant limits add to a request instead (mesh only, run
against serve_configs/tenants.yaml): (a) the router's asks to each ledger backend
(``TenantLimiter.acquire`` + release from a Ray driver on this node, against the running
mesh's ``SharedTenantCounts`` actor and against a real redis-server the benchmark starts),
p50/p95 ms per ask and asks/s (one router's ceiling of limited requests/s) at each
concurrency, batched (the default) and unbatched (one call per ask) side by side; (b) end to end, TTFT p50 of a
tenant with limits (acme) against one without (ops), the same load run alternately.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.cli import build_parser, main  # noqa: E402
from bench.script_args import run  # noqa: E402

if __name__ == "__main__":
    run(lambda: main(build_parser(__doc__)))
