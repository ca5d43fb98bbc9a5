#!/usr/bin/env python
"""Overload drill: a flood of low-priority requests against a high-priority tenant.

Against a running mesh deployed from --config (default serve_configs/tenants.yaml):
  1. the probe tenant (acme, priority 0) sends streamed chats on the idle mesh;
  2. the flood tenant (batch, priority 10) sends --requests chats all at once (max_tokens
     16, no client retries, 60 s client timeout) while the probe keeps sending;
  3. with --compare, the same again with every tenant at one priority (deployed in place
     with `serve deploy`, then the original config is deployed back).
Prints what the flood got (answers, 429/503 with Retry-After, client timeouts, how fast the
refusals came) and the probe's TTFT against idle.

  ./scripts/demo.sh serve_configs/tenants.yaml
  .venv/bin/python scripts/drill_overload.py --requests 400 --compare
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_app.release.deploy import DEFAULT_DASHBOARD, deploy  # noqa: E402
from bench.drills import format_figures, overload_drill, without_priorities  # noqa: E402
from serve_app.common.serve_configs import load_yaml  # noqa: E402
from bench.script_args import run, script_parser  # noqa: E402


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="the mesh's OpenAI base URL")
    p.add_argument("--config", default="serve_configs/tenants.yaml",
                   help="the config deployed now (for --compare)")
    p.add_argument("-a", "--address", default=DEFAULT_DASHBOARD, help="Ray dashboard")
    p.add_argument("--flood-key", default="sk-batch-demo", help="low-priority tenant's key")
    p.add_argument("--probe-key", default="sk-acme-demo", help="high-priority tenant's key")
    p.add_argument("--requests", type=int, default=400, help="the flood's requests")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--timeout-s", type=float, default=60, help="the flood's client timeout")
    p.add_argument("--queue-timeout-s", type=float, default=30,
                   help="the route's admission queue_timeout_s (tenants.yaml: 30), for the "
                   "goodput ratio")
    p.add_argument("--compare", action="store_true",
                   help="also run with priorities off, deployed in place, then restore")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    if args.compare:
        load_yaml(args.config)  # a bad file stops here, before the flood

    def drill() -> dict:
        return asyncio.run(overload_drill(
            args.base_url, flood_key=args.flood_key, probe_key=args.probe_key,
            requests=args.requests, max_tokens=args.max_tokens, timeout_s=args.timeout_s,
            queue_timeout_s=args.queue_timeout_s))

    results = {"priority_on": drill()}
    if args.compare:
        off = Path(tempfile.mkdtemp()) / "priority-off.yaml"
        off.write_text(yaml.safe_dump(without_priorities(load_yaml(args.config)),
                                      sort_keys=False))
        deploy(off, args.address)
        try:
            results["priority_off"] = drill()
        finally:
            deploy(args.config, args.address)
    for label, figures in results.items():
        print("\n".join(format_figures(label.replace("_", " "), figures)))
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    run(main)
