"""``meshctl``: the mesh's command line (also ``python -m serve_app.cli``).

    meshctl validate CONFIG...        check Serve configs before `serve deploy` (exit 1 if bad)
    meshctl validate NEW --against OLD|live [--allow-restart]
                                      also exit 1 if NEW would restart replicas of OLD
    meshctl diff OLD|live NEW [--fail-on-restart]
                                      per application: what restarts, what changes in place
    meshctl deploy CONFIG [-a URL]    validate, `serve deploy`, wait until RUNNING
    meshctl wait CONFIG [-a URL]      wait until the applications of CONFIG are RUNNING
    meshctl swap CONFIG --route R --new-app APP --model M [--steps 50,100] [--emit DIR]
                                      blue/green base-model swap of a route (serve_app.release.swap)
    meshctl hash-key [KEY]            SHA-256 of an API key for tenants[].api_keys_sha256
                                      (reads the key from stdin when not given)
    meshctl rollout-report [--split S] [--out DIR] [--router-url URL] [--prometheus URL]
                                      PNG + Markdown of a rollout (admin key: $MESH_ADMIN_KEY)
    meshctl rollout status [--watch] [--timeout S] [--report DIR] [--split KEY]
                                      a rollout's state, or --watch it until its verdict:
                                      exit 0 promoted, 2 rolled back, 3 aborted, 4 timeout,
                                      5 mesh unreachable, 6 in progress (rollout_watch)
    meshctl top-adapters CONFIG [--metrics URL|FILE] [--top N] [--emit FILE]
                                      adapters by tokens (the router's counters), and the
                                      config that serves the top N from merged weights
    meshctl kuberay CONFIG [-o FILE] [--name NAME] [--image IMAGE] [--head-cpus N]
                    [--head-memory Q] [--worker-memory Q] [--spare-workers N]
                                      KubeRay RayService manifest of CONFIG (exit 1 if invalid)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx
import yaml

from serve_app.release.config_diff import diff_configs, format_report, restarts
from serve_app.release.deploy import (DEFAULT_DASHBOARD, DeployError, deploy, load_config,
                                      wait_until_running)
from serve_app.common.serve_configs import applications, load_yaml, mesh_parts
from serve_app.release import kuberay, merge_plan, rollout_watch
from serve_app.release.rollout_report import fetch_rollouts, write_report
from serve_app.release.swap import apply_plan, parse_steps, plan_swap, write_plan
from serve_app.ingress.tenancy import hash_api_key
from serve_app.release.validate import config_warnings, validate_config


def _validate(paths: list[str]) -> bool:
    ok = True
    for path in paths:
        warnings: list[str] = []
        try:
            config = load_yaml(path)
            problems = validate_config(config)
            if not problems:
                warnings = config_warnings(config)
        except (OSError, ValueError) as e:
            problems = [str(e)]
        for w in warnings:
            print(f"{path}: WARNING {w}", file=sys.stderr)
        if problems:
            ok = False
            print(f"{path}: INVALID", file=sys.stderr)
            for p in problems:
                for line in p.splitlines():
                    print(f"  {line}", file=sys.stderr)
        else:
            print(f"{path}: ok")
    return ok


def _report(old: str, new: str, address: str, *, refuse_restart: bool) -> bool:
    """Print the change report of ``new`` against ``old`` (a file or ``live``); False when
    ``refuse_restart`` and a change restarts replicas (each one explained on stderr)."""
    new_config = load_config(new, address)
    report = diff_configs(load_config(old, address), new_config)
    print(f"{new} against {old}:")
    for line in format_report(report):
        print(f"  {line}")
    restarting = restarts(report)
    if refuse_restart and restarting:
        print(f"{new}: REFUSED: {len(restarting)} change(s) restart replicas:", file=sys.stderr)
        for c in restarting:
            print(f"  {c}", file=sys.stderr)
        variant = mesh_parts(new_config).variant_apps.get(restarting[0].app) or {}
        args = variant.get("args") or {}
        print("  A restarted vLLM replica serves nothing until its new engine is up. Release "
              "new args blue/green instead (a new variant application, weights shifted to it, "
              "the old one retired), e.g. for a new base model:\n"
              f"    meshctl swap {old if old != 'live' else 'CURRENT_CONFIG'} "
              f"--route {args.get('served_model_name', 'ROUTE')} "
              f"--new-app {restarting[0].app}-next --model {args.get('model', 'MODEL')}\n"
              "  or accept the restart: --allow-restart (validate), no --fail-on-restart (diff).",
              file=sys.stderr)
        return False
    return True


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("-a", "--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS",
                                                              DEFAULT_DASHBOARD),
                   help="Ray dashboard address (default %(default)s)")


def _swap(args: argparse.Namespace) -> int:
    plan = plan_swap(load_yaml(args.config), route=args.route, new_app=args.new_app,
                     model=args.model, steps=parse_steps(args.steps), from_app=args.from_app)
    for i, s in enumerate(plan):
        print(f"[swap] plan {s.filename(i)}: "
              + ", ".join(f"{a}={w}" for a, w in s.weights.items()))
    if args.emit:
        paths = write_plan(plan, args.emit)
        print(f"[swap] wrote {len(paths)} configs to {args.emit}; apply them in order with "
              f"`serve deploy` (wait until RUNNING after each, pause after the weight steps); "
              f"the new desired state is {paths[-1]}")
    else:
        apply_plan(plan, args.address, pause_s=args.pause_s, timeout_s=args.timeout_s)
    return 0


def _rollout_report(args: argparse.Namespace) -> int:
    try:
        rollouts = fetch_rollouts(args.router_url, args.admin_key)
    except httpx.HTTPError as e:
        print(f"meshctl rollout-report: cannot read {args.router_url}/admin/rollouts ({e}); "
              "pass the router's address with --router-url and an admin key with --admin-key",
              file=sys.stderr)
        return 1
    chosen = {k: r for k, r in rollouts.items() if args.split in (None, k)}
    if not chosen:
        print(f"meshctl rollout-report: no rollout {args.split or ''} (rollouts: "
              f"{', '.join(rollouts) or 'none'})", file=sys.stderr)
        return 1
    for rollout in chosen.values():
        report = write_report(rollout, Path(args.out), args.prometheus or None)
        print(f"{rollout['key']}: {rollout['state']}: wrote {report.png} and {report.markdown}")
    return 0


def _kuberay(args: argparse.Namespace) -> int:
    try:
        config = load_yaml(args.config)
    except (OSError, ValueError) as e:
        print(f"{args.config}: INVALID (no manifest written)\n  {e}", file=sys.stderr)
        return 1
    try:
        manifest = kuberay.rayservice_manifest(
            config, name=args.name, image=args.image, namespace=args.namespace,
            head_cpus=args.head_cpus, head_memory=args.head_memory,
            worker_memory=args.worker_memory, spare_workers=args.spare_workers)
    except kuberay.ManifestError as e:
        print(f"{args.config}: INVALID (no manifest written)", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    for w in kuberay.manifest_warnings(config, manifest):
        print(f"{args.config}: WARNING {w}", file=sys.stderr)
    text = kuberay.manifest_yaml(manifest, source=args.config)
    if args.output:
        Path(args.output).write_text(text)
        groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        print(f"wrote {args.output}: RayService {args.name}, worker groups "
              + (", ".join(f"{g['groupName']} ({g['replicas']} pods)" for g in groups)
                 or "none"))
    else:
        sys.stdout.write(text)
    return 0


def _top_adapters(args: argparse.Namespace) -> int:
    source = args.metrics
    try:
        text = (httpx.get(source, timeout=30).raise_for_status().text
                if source.startswith(("http://", "https://")) else Path(source).read_text())
    except (httpx.HTTPError, OSError) as e:
        print(f"meshctl top-adapters: cannot read the router's metrics from {source} ({e}); "
              "pass a Ray node's metrics export (http://<node>:8080/metrics) with --metrics",
              file=sys.stderr)
        return 1
    config = load_yaml(args.config)
    tokens = merge_plan.adapter_tokens(text)
    if not tokens:
        print(f"meshctl top-adapters: no adapter tokens in {source} yet (series "
              f"{' + '.join(merge_plan.TOKEN_SERIES)} with a non-empty adapter label)",
              file=sys.stderr)
        return 1
    new, steps = merge_plan.plan_merges(config, tokens, args.top)
    print("\n".join(merge_plan.format_table(tokens, steps)))
    if not steps:
        print("nothing to merge: the top adapters have merged variants already")
        return 0
    for s in steps:
        print(f"\n{s.route}:{s.adapter} ({s.version}) -> variant {s.application}, model "
              f"{s.model}\n  " + (f"build the model first: {s.build}" if s.build else
                                  f"model {s.model} is built already"))
    if args.emit:
        Path(args.emit).write_text(yaml.safe_dump(new, sort_keys=False))
        print(f"\nwrote {args.emit}: review it, then `meshctl validate {args.emit}` and "
              f"`serve deploy {args.emit}` (nothing was deployed)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshctl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check Serve configs of the mesh")
    p.add_argument("configs", nargs="+")
    p.add_argument("--against", metavar="OLD",
                   help="also report changes against OLD (a file, or `live`: the deployed "
                        "config) and refuse those that restart replicas")
    p.add_argument("--allow-restart", action="store_true",
                   help="with --against: accept changes that restart replicas")
    _add_address(p)
    p = sub.add_parser("diff", help="what a new config restarts and what it changes in place")
    p.add_argument("old", help="the current config file, or `live` (the deployed config)")
    p.add_argument("new")
    p.add_argument("--fail-on-restart", action="store_true",
                   help="exit 1 when a change restarts replicas")
    _add_address(p)
    for name, help_ in (("deploy", "validate, serve deploy, wait until RUNNING"),
                        ("wait", "wait until the config's applications are RUNNING")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config")
        _add_address(p)
        p.add_argument("--timeout-s", type=float, default=900)
    p = sub.add_parser("swap", help="blue/green base-model swap of one route")
    p.add_argument("config", help="the Serve config deployed now")
    p.add_argument("--route", required=True, help="the route to move (e.g. smollm)")
    p.add_argument("--new-app", required=True, help="name of the new variant application")
    p.add_argument("--model", required=True, help="the new variant's args.model")
    p.add_argument("--from-app", help="variant application to copy (default: the route's "
                                      "variant with a positive weight)")
    p.add_argument("--steps", default="100",
                   help="new variant's weight percentages, ending at 100 (default %(default)s)")
    p.add_argument("--pause-s", type=float, default=10,
                   help="seconds to wait after each weight step (default %(default)s)")
    p.add_argument("--emit", metavar="DIR",
                   help="only write the numbered configs to DIR (for CI), apply nothing")
    _add_address(p)
    p.add_argument("--timeout-s", type=float, default=900, help="per step")
    p = sub.add_parser("rollout-report", help="PNG and Markdown report of a rollout")
    p.add_argument("--split", help="the rollout's split key (a route, or route:adapter); "
                                   "default: every rollout")
    p.add_argument("--out", default="rollout-report", help="output folder (default %(default)s)")
    p.add_argument("--router-url", default="http://127.0.0.1:8000")
    p.add_argument("--admin-key", default=os.environ.get("MESH_ADMIN_KEY", ""),
                   help="an admin tenant's API key (default: $MESH_ADMIN_KEY)")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090",
                   help="Prometheus for the figures over time; '' to go without")
    rollout_watch.add_parser(sub)
    p = sub.add_parser("kuberay", help="KubeRay RayService manifest of a Serve config")
    p.add_argument("config")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    p.add_argument("--name", default=kuberay.DEFAULT_NAME,
                   help="the RayService's name (default %(default)s)")
    p.add_argument("--namespace", metavar="NS", help="metadata.namespace (default: kubectl's)")
    p.add_argument("--image", default=kuberay.DEFAULT_IMAGE,
                   help="image of every pod, built from deploy/kuberay/Dockerfile "
                        "(default %(default)s)")
    p.add_argument("--head-cpus", type=int, metavar="N", default=kuberay.DEFAULT_HEAD_CPUS,
                   help="CPUs of the head pod: router, rollout controller, Serve controller "
                        "(default %(default)s)")
    p.add_argument("--head-memory", metavar="Q", default=kuberay.DEFAULT_HEAD_MEMORY,
                   help="memory of the head pod (default %(default)s)")
    p.add_argument("--worker-memory", metavar="Q", default=kuberay.DEFAULT_WORKER_MEMORY,
                   help="memory of an engine's pod when its ray_actor_options has no memory "
                        "(default %(default)s)")
    p.add_argument("--spare-workers", type=int, metavar="N", default=0,
                   help="pods a worker group may add past its engines (surge replacements, "
                        "blue/green variants); > 0 turns on the Ray autoscaler (default 0)")
    p = sub.add_parser("top-adapters", help="adapters by tokens, and the config change that "
                       "serves the top ones from merged weights")
    p.add_argument("config", help="the Serve config deployed now")
    p.add_argument("--metrics", default="http://127.0.0.1:8080/metrics",
                   help="the router's metrics: a Ray node's export URL or a saved file "
                   "(default %(default)s)")
    p.add_argument("--top", type=int, default=1, help="adapters to merge (default 1)")
    p.add_argument("--emit", help="write the changed config here")
    p = sub.add_parser("hash-key", help="print the SHA-256 digest of an API key")
    p.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    args = parser.parse_args(argv)

    if args.command == "hash-key":
        print(hash_api_key(args.key if args.key is not None else sys.stdin.readline().strip()))
        return 0
    if args.command == "rollout-report":
        return _rollout_report(args)
    if args.command == "rollout":
        return rollout_watch.status_command(args)
    if args.command == "top-adapters":
        try:
            return _top_adapters(args)
        except (OSError, ValueError) as e:
            print(f"meshctl top-adapters: {e}", file=sys.stderr)
            return 1
    try:
        if args.command == "validate":
            if args.allow_restart and not args.against:
                parser.error("--allow-restart needs --against OLD")
            ok = _validate(args.configs)
            if ok and args.against:
                ok = all([_report(args.against, c, args.address, refuse_restart=not
                                  args.allow_restart) for c in args.configs])
            return 0 if ok else 1
        if args.command == "diff":
            return 0 if _report(args.old, args.new, args.address,
                                refuse_restart=args.fail_on_restart) else 1
        if args.command == "swap":
            return _swap(args)
        if args.command == "kuberay":
            return _kuberay(args)
    except httpx.HTTPError as e:
        print(f"meshctl {args.command}: cannot read the Serve status from the Ray dashboard at "
              f"{args.address} ({e}); pass its address with -a", file=sys.stderr)
        return 1
    except (OSError, ValueError, DeployError) as e:  # SwapError is a ValueError
        print(f"meshctl {args.command}: {e}", file=sys.stderr)
        return 1
    try:
        if args.command == "deploy":
            if not _validate([args.config]):
                return 1
            deploy(args.config, args.address, timeout_s=args.timeout_s)
        else:
            names = [a["name"] for a in applications(load_yaml(args.config))]
            wait_until_running(args.address, names, {}, timeout_s=args.timeout_s)
    except DeployError as e:
        print(f"meshctl: {e}", file=sys.stderr)
        return 1
    print("all applications RUNNING")
    return 0


if __name__ == "__main__":
    sys.exit(main())
