"""``meshctl rollout-report`` and ``meshctl top-adapters``: what the mesh did, read back from
it: a rollout's report (PNG + Markdown, :mod:`serve_app.release.rollout_report`), and the
adapters by tokens with the config that serves the top ones from merged weights
(:mod:`serve_app.release.merge_plan`). ``rollout status`` is
:mod:`serve_app.release.rollout_watch`'s."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx
import yaml

from serve_app.commands.base import REFUSED_EXIT, UsageError, one_line, read_config
from serve_app.common.serve_configs import mesh_parts
from serve_app.release import merge_plan
from serve_app.release.rollout_report import ReportError, fetch_rollouts, write_report


def rollout_report_command(args: argparse.Namespace) -> int:
    """``meshctl rollout-report``: 0 written, 1 no such rollout.

    Raises:
        UsageError: the router does not answer ``/admin/rollouts``; the report cannot be
            written (no matplotlib, an unwritable folder).
    """
    try:
        rollouts = fetch_rollouts(args.router_url, args.admin_key)
    except (httpx.HTTPError, ValueError) as e:
        raise UsageError(f"cannot read {args.router_url}/admin/rollouts ({type(e).__name__}: "
                         f"{one_line(e)}); pass the router's address with --router-url and "
                         "an admin key with --admin-key") from None
    chosen = {k: r for k, r in rollouts.items() if args.split in (None, k)}
    if not chosen:
        print(f"meshctl rollout-report: no rollout {args.split or ''} (rollouts: "
              f"{', '.join(rollouts) or 'none'})", file=sys.stderr)
        return REFUSED_EXIT
    for rollout in chosen.values():
        try:
            report = write_report(rollout, Path(args.out), args.prometheus or None)
        except ReportError as e:
            raise UsageError(str(e)) from None
        print(f"{rollout['key']}: {rollout['state']}: wrote {report.png} and {report.markdown}")
    return 0


def top_adapters_command(args: argparse.Namespace) -> int:
    """``meshctl top-adapters``: 0 ranked (and, with ``--emit``, the config written), 1 the
    metrics hold no adapter tokens yet.

    Raises:
        UsageError: the config has no mesh router or cannot be read; the metrics cannot be
            read; ``--emit`` cannot be written.
    """
    config = read_config(args.config)
    if mesh_parts(config).router_user_config is None:
        raise UsageError(f"{args.config} has no mesh router (serve_app.router:build_app) with "
                         "a user_config: pass the Serve config deployed now")
    source = args.metrics
    try:
        text = (httpx.get(source, timeout=30).raise_for_status().text
                if source.startswith(("http://", "https://")) else Path(source).read_text())
        tokens = merge_plan.adapter_tokens(text)
    except (httpx.HTTPError, OSError, ValueError) as e:
        raise UsageError(f"cannot read the router's metrics from {source} ("
                         f"{one_line(getattr(e, 'strerror', None) or e)}); pass a Ray node's "
                         "metrics export (http://<node>:8080/metrics: ray start "
                         "--metrics-export-port=8080, as scripts/demo.sh does) or a saved copy "
                         "with --metrics") from None
    if not tokens:
        print(f"meshctl top-adapters: no adapter tokens in {source} yet (series "
              f"{' + '.join(merge_plan.TOKEN_SERIES)} with a non-empty adapter label)",
              file=sys.stderr)
        return REFUSED_EXIT
    new, steps = merge_plan.plan_merges(config, tokens, args.top)
    print("\n".join(merge_plan.format_table(tokens, steps)))
    if not steps:
        print("nothing to merge:")
        for (route, adapter), _ in tokens.most_common(args.top):
            print(f"  {route}:{adapter}: {merge_plan.not_mergeable(config, route, adapter)}")
        if any(merge_plan.not_mergeable(config, r, a).startswith(("no variant", "route"))
               for (r, a), _ in tokens.most_common(args.top)):
            print(f"  (is {args.config} the config deployed now? The metrics count what the "
                  "mesh served.)")
        return 0
    for s in steps:
        print(f"\n{s.route}:{s.adapter} ({s.version}) -> variant {s.application}, model "
              f"{s.model}\n  " + (f"build the model first: {s.build}" if s.build else
                                  f"model {s.model} is built already"))
    if args.emit:
        try:
            Path(args.emit).write_text(yaml.safe_dump(new, sort_keys=False))
        except OSError as e:
            raise UsageError(f"cannot write {args.emit}: {e.strerror or e}") from None
        print(f"\nwrote {args.emit}: review it, then `meshctl validate {args.emit}` and "
              f"`serve deploy {args.emit}` (nothing was deployed)")
    return 0



def add_rollout_report(sub) -> None:
    """Add ``rollout-report`` to meshctl's subcommands (``sub``: argparse's subparsers)."""
    p = sub.add_parser("rollout-report", help="PNG and Markdown report of a rollout")
    p.add_argument("--split", help="the rollout's split key (a route, or route:adapter); "
                                   "default: every rollout")
    p.add_argument("--out", default="rollout-report", help="output folder (default %(default)s)")
    p.add_argument("--router-url", default="http://127.0.0.1:8000",
                   help="the mesh's HTTP address (default %(default)s)")
    p.add_argument("--admin-key", default=os.environ.get("MESH_ADMIN_KEY", ""),
                   help="an admin tenant's API key (default: $MESH_ADMIN_KEY)")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090",
                   help="Prometheus for the figures over time; '' to go without "
                        "(default %(default)s)")


def add_top_adapters(sub) -> None:
    """Add ``top-adapters`` to meshctl's subcommands (``sub``: argparse's subparsers)."""
    p = sub.add_parser("top-adapters", help="adapters by tokens, and the config change that "
                       "serves the top ones from merged weights")
    p.add_argument("config", help="the Serve config deployed now")
    p.add_argument("--metrics", default="http://127.0.0.1:8080/metrics",
                   help="the router's metrics: a Ray node's export URL or a saved file "
                   "(default %(default)s)")
    p.add_argument("--top", type=int, default=1, help="adapters to merge (default 1)")
    p.add_argument("--emit", help="write the changed config here")
