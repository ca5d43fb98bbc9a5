"""``meshctl``: the mesh's command line (also ``python -m serve_app.cli``).

    meshctl validate CONFIG... [--offline]
                                      check Serve configs before `serve deploy`: the mesh's
                                      checks, files on this host, vLLM's verdict on engine args
                                      (against each model's config.json, read from the hub or
                                      the bucket unless --offline)
    meshctl validate NEW --against OLD|live [--allow-restart]
                                      also refuse NEW if it would restart replicas of OLD
    meshctl diff OLD|live NEW [--fail-on-restart]
                                      validate NEW, then per application: what restarts, what
                                      changes in place (list items one by one)
    meshctl deploy CONFIG [-a URL]    validate, `serve deploy`, wait until RUNNING
    meshctl wait CONFIG [-a URL]      wait until the applications of CONFIG are RUNNING
    meshctl swap CONFIG --route R --new-app APP [--model M] [--engine-arg K=V ...]
                 [--steps 50,100] [--emit DIR]
                                      blue/green release of a new base model or new engine
                                      args (serve_app.release.swap)
    meshctl hash-key [KEY]            SHA-256 of an API key for tenants[].api_keys_sha256
                                      (reads the key from stdin when not given)
    meshctl rollout-report [--split S] [--out DIR] [--router-url URL] [--prometheus URL]
                                      PNG + Markdown of a rollout (admin key: $MESH_ADMIN_KEY)
    meshctl rollout status [--watch] [--timeout S] [--report DIR] [--split KEY]
                                      a rollout's state, or --watch it until its verdict:
                                      exit 0 promoted, 1 usage, 2 rolled back, 3 aborted,
                                      4 timeout, 5 mesh unreachable, 6 in progress
    meshctl top-adapters CONFIG [--metrics URL|FILE] [--top N] [--emit FILE]
                                      adapters by tokens (the router's counters), and the
                                      config that serves the top N from merged weights
    meshctl kuberay CONFIG [-o FILE] [--name NAME] [--image IMAGE] [--head-cpus N]
                    [--head-memory Q] [--worker-memory Q] [--spare-workers N]
                    [--ingress proxy|haproxy] [--overlay FLEET_FILE]
                                      KubeRay RayService manifest of CONFIG

Exit status (all but ``rollout status``): 0 done; 1 refused (an invalid config, a refused
restart, a failed or timed-out deploy); 2 could not run (bad arguments, a file that cannot
be read or is not YAML, an address that does not answer), with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn

import httpx
import yaml

from serve_app.release.config_diff import diff_configs, restarts
from serve_app.release.deploy import (DEFAULT_DASHBOARD, DeployError, deploy, live_config,
                                      serve_status, wait_until_running)
from serve_app.common.serve_configs import applications, load_yaml, mesh_parts
from serve_app.common.serve_env import DEFAULT_INGRESS, INGRESSES
from serve_app.release import kuberay, merge_plan, rollout_watch
from serve_app.release.change_lines import report_lines
from serve_app.release.rollout_report import ReportError, fetch_rollouts, write_report
from serve_app.release.swap import InvalidPlan, apply_plan, parse_steps, plan_swap, write_plan
from serve_app.tenancy.keys import hash_api_key
from serve_app.release.engine_check import VLLM_IMPORT_TIME
from serve_app.release.manifest_paths import deployable_copy, with_config_folder
from serve_app.release.validate import config_warnings, validate_config

#: Exit status of a command that cannot do its job: bad arguments, a file that cannot be
#: read or is not YAML, an address that does not answer (argparse's own code for bad
#: arguments). ``rollout status`` keeps its own table (:data:`rollout_watch.EXIT_CODES`).
USAGE_EXIT = 2
#: Exit status of a verdict of no: an invalid config, a refused restart, a failed deploy.
REFUSED_EXIT = 1


class UsageError(Exception):
    """A command cannot run as asked; the message is one line that says how to fix it."""


class _Parser(argparse.ArgumentParser):
    """argparse, with one line of error (and the hint to ``--help``) and a settable exit
    status for bad arguments (``rollout status`` exits 1 on them, as its table says)."""

    usage_exit = USAGE_EXIT
    #: subcommand path (``("rollout", "status")``) -> its parser, for the top-level parser's
    #: "unrecognized arguments", which argparse reports from the top
    subcommands: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    argv: list[str] = []

    def parse_args(self, args=None, namespace=None):  # noqa: D102 -- argparse's
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments"):
            for path, sub in self.subcommands.items():
                if tuple(self.argv[:len(path)]) == path:
                    sub.error(message)
        self.exit(self.usage_exit, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def read_config(path: str) -> dict[str, Any]:
    """A Serve config file as a dict.

    Raises:
        UsageError: the file is missing or unreadable, not YAML (with the line and column),
            or not a mapping.
    """
    try:
        return load_yaml(path)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # load_yaml's message starts with the path
        raise UsageError(_one_line(e)) from None


def _dashboard(address: str) -> dict[str, Any]:
    """The dashboard's Serve status, or a UsageError that says where Ray was looked for."""
    try:
        return serve_status(address)
    except (httpx.HTTPError, ValueError) as e:
        raise UsageError(f"cannot reach the Ray dashboard at {address} ({type(e).__name__}: "
                         f"{_one_line(e) or 'no answer'}); is Ray running (`ray status`)? "
                         "pass its address with -a or $RAY_DASHBOARD_ADDRESS") from None


def _config_or_live(source: str, address: str) -> dict[str, Any]:
    """A config file, or ``live``: the config deployed now on the cluster at ``address``."""
    if source != "live":
        return with_config_folder(read_config(source), source)
    _dashboard(address)
    try:
        return live_config(address)
    except (httpx.HTTPError, ValueError) as e:
        raise UsageError(f"live: {_one_line(e)}") from None


def _problems(config: dict[str, Any], *, engine: bool,
              offline: bool | None = None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a config: the mesh's checks, then vLLM's of the engine args
    (``engine``) when the rest is valid; ``offline``: read no model's config over the
    network (None: only under ``HF_HUB_OFFLINE``)."""
    problems = validate_config(config)
    if problems:
        return problems, []
    warnings = config_warnings(config)
    if engine:
        from serve_app.release.engine_check import engine_problems, vllm_installed

        if "vllm" not in sys.modules and mesh_parts(config).variant_apps and vllm_installed():
            print(f"meshctl: asking vLLM about the engine args (importing it takes "
                  f"{VLLM_IMPORT_TIME}; --skip-engine-check skips this)", file=sys.stderr,
                  flush=True)
        engine_found, engine_warnings = engine_problems(config, offline=offline)
        problems += engine_found
        warnings += engine_warnings
    return problems, warnings


def _print_verdict(path: str, problems: list[str], warnings: list[str]) -> bool:
    for w in warnings:
        print(f"{path}: WARNING {w}", file=sys.stderr)
    if problems:
        print(f"{path}: INVALID", file=sys.stderr)
        for p in problems:
            for line in p.splitlines():
                print(f"  {line}", file=sys.stderr)
        return False
    print(f"{path}: ok")
    return True


def _validate(paths: list[str], *, engine: bool = True, offline: bool | None = None) -> int:
    """``meshctl validate``: 0 all valid, 1 one is invalid, 2 one cannot be read."""
    code = 0
    for path in paths:
        try:
            config = with_config_folder(read_config(path), path)
        except UsageError as e:
            print(f"meshctl validate: {e}", file=sys.stderr)
            code = USAGE_EXIT
            continue
        if not _print_verdict(path, *_problems(config, engine=engine, offline=offline)):
            code = code or REFUSED_EXIT
    return code


def _report(old: str, new: str, address: str, *, refuse_restart: bool,
            validate: bool = True, engine: bool = True, offline: bool | None = None) -> int:
    """Print the change report of ``new`` against ``old`` (a file or ``live``), after
    validating ``new`` (``validate``). Returns 1 when ``new`` is invalid, or when
    ``refuse_restart`` and a change restarts replicas (each one explained on stderr)."""
    new_config = with_config_folder(read_config(new), new)
    old_config = _config_or_live(old, address)
    if validate and not _print_verdict(new, *_problems(new_config, engine=engine,
                                                       offline=offline)):
        print(f"meshctl: {new} is invalid: no change report (fix it first)", file=sys.stderr)
        return REFUSED_EXIT
    report = diff_configs(old_config, new_config)
    print(f"{new} against {old}:")
    for line in report_lines(report):
        print(f"  {line}")
    restarting = restarts(report)
    if refuse_restart and restarting:
        print(f"{new}: REFUSED: the {len(restarting)} RESTART change(s) above restart "
              "replicas.", file=sys.stderr)
        print(_blue_green_hint(old, new_config, restarting), file=sys.stderr)
        return REFUSED_EXIT
    return 0


def _blue_green_hint(old: str, new_config: dict[str, Any], restarting) -> str:
    """How to ship the restarting changes without a restart: ``meshctl swap`` with the new
    variant's model and engine args (those it can carry), else by hand."""
    change = restarting[0]
    variant = mesh_parts(new_config).variant_apps.get(change.app) or {}
    args = variant.get("args") or {}
    command = (f"    meshctl swap {old if old != 'live' else 'CURRENT_CONFIG'} "
               f"--route {args.get('served_model_name', 'ROUTE')} "
               f"--new-app {change.app}-next")
    fields = [c.field for c in restarting if c.app == change.app]
    carried = all(f == "args.model" or f.startswith("args.engine_args.") for f in fields)
    if "args.model" in fields:
        command += f" --model {args.get('model', 'MODEL')}"
    for key in dict.fromkeys(f.removeprefix("args.engine_args.").split(".")[0]
                             for f in fields if f.startswith("args.engine_args.")):
        value = (args.get("engine_args") or {}).get(key)  # None: removed (null)
        flow = yaml.safe_dump(value, default_flow_style=True, width=10_000)
        flow = flow.strip().removesuffix("...").strip()  # a scalar document ends in "..."
        command += " --engine-arg " + shlex.quote(f"{key}={flow}")
    return ("  A restarted vLLM replica serves nothing until its new engine is up. Release "
            "new args blue/green instead (a new variant application, weights shifted to it, "
            "the old one retired; docs/operating.md, \"Change engine args blue/green\")"
            + (", from the config deployed now:\n" + command if carried and variant else
               ": copy the variant application under a new name with the new settings, add "
               "it to the route at weight 0, then shift the weight (docs/base-swaps.md)")
            + "\n  or accept the restart: --allow-restart (validate), no --fail-on-restart "
              "(diff).")


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("-a", "--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS",
                                                              DEFAULT_DASHBOARD),
                   help="Ray dashboard address (default: $RAY_DASHBOARD_ADDRESS or "
                        f"{DEFAULT_DASHBOARD})")


def _add_engine_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-engine-check", action="store_true",
                   help="skip vLLM's checks of the variants' engine args (they import vLLM: "
                        f"{VLLM_IMPORT_TIME}); the replica still runs them when it starts")
    p.add_argument("--offline", action="store_true",
                   help="read no model's config.json from the hub or a bucket (also under "
                        "HF_HUB_OFFLINE=1): engine args are checked without the models not "
                        "on this host, and a warning names the checks left out")


def _engine_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as YAML (``8``, ``true``, ``{backend: guidance}``;
    ``null`` removes the key)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE, e.g. max_num_seqs=16")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"{text!r}: VALUE is not YAML") from None


def _steps(text: str) -> list[int]:
    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _swap(args: argparse.Namespace) -> int:
    if args.model is None and not args.engine_arg:
        raise UsageError("give the new variant's --model, or --engine-arg KEY=VALUE, or both")
    config = read_config(args.config)
    try:
        plan = plan_swap(config, route=args.route, new_app=args.new_app, model=args.model,
                         engine_args=dict(args.engine_arg or []), steps=args.steps,
                         from_app=args.from_app)
    except InvalidPlan as e:
        print(f"meshctl swap: {e}", file=sys.stderr)
        return REFUSED_EXIT
    except ValueError as e:  # SwapError: the arguments do not fit the config
        raise UsageError(str(e)) from None
    if not args.skip_engine_check:
        from serve_app.release.engine_check import engine_problems

        problems, _ = engine_problems(plan[-1].config, offline=args.offline or None)
        if problems:
            print(f"meshctl swap: the new variant's engine args are invalid; nothing was "
                  "written or applied:", file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            return REFUSED_EXIT
    for i, s in enumerate(plan):
        print(f"[swap] plan {s.filename(i)}: "
              + ", ".join(f"{a}={w}" for a, w in s.weights.items()))
    if args.emit:
        paths = write_plan(plan, args.emit)
        print(f"[swap] wrote {len(paths)} configs to {args.emit}; apply them in order with "
              f"`serve deploy` (wait until RUNNING after each, pause after the weight steps); "
              f"the new desired state is {paths[-1]}")
    else:
        _dashboard(args.address)
        apply_plan(plan, args.address, pause_s=args.pause_s, timeout_s=args.timeout_s)
    return 0


def _rollout_report(args: argparse.Namespace) -> int:
    try:
        rollouts = fetch_rollouts(args.router_url, args.admin_key)
    except (httpx.HTTPError, ValueError) as e:
        raise UsageError(f"cannot read {args.router_url}/admin/rollouts ({type(e).__name__}: "
                         f"{_one_line(e)}); pass the router's address with --router-url and "
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


def _kuberay(args: argparse.Namespace) -> int:
    config = read_config(args.config)
    overlay = _read_yaml(args.overlay) if args.overlay else None
    try:
        manifest = kuberay.rayservice_manifest(
            config, name=args.name, image=args.image, namespace=args.namespace,
            head_cpus=args.head_cpus, head_memory=args.head_memory,
            worker_memory=args.worker_memory, spare_workers=args.spare_workers,
            ingress=args.ingress, overlay=overlay)
    except kuberay.ManifestError as e:
        print(f"{args.config}: INVALID (no manifest written)", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return REFUSED_EXIT
    for w in kuberay.manifest_warnings(config, manifest, overlay=overlay,
                                       worker_memory=args.worker_memory):
        print(f"{args.config}: WARNING {w}", file=sys.stderr)
    source = args.config + (f" --overlay {args.overlay}" if args.overlay else "")
    text = kuberay.manifest_yaml(manifest, source=source, sizing=kuberay.pod_sizing(
        config, worker_memory=args.worker_memory))
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
        groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        print(f"wrote {args.output}: RayService {args.name}, worker groups "
              + (", ".join(f"{g['groupName']} ({g['replicas']} pods of "
                           + _pod_figures(g) + ")" for g in groups) or "none"))
    else:
        sys.stdout.write(text)
    return 0


def _pod_figures(group: dict[str, Any]) -> str:
    """``4 CPUs, 30Gi, 2 GPUs``: a worker group's pod limits."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return (f"{limits['cpu']} CPUs, {limits['memory']}"
            + (f", {limits['nvidia.com/gpu']} GPUs" if "nvidia.com/gpu" in limits else ""))


def _read_yaml(path: str) -> Any:
    """A YAML file's content (None for an empty one).

    Raises:
        UsageError: the file is missing, unreadable or not YAML.
    """
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{path} is not YAML: {_one_line(e)}") from None


def _top_adapters(args: argparse.Namespace) -> int:
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
                         f"{_one_line(getattr(e, 'strerror', None) or e)}); pass a Ray node's "
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


def _hash_key(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key.strip():
        raise UsageError("the key is empty: pass the API key as the argument, or as one line "
                         "on stdin (`meshctl hash-key < keyfile`)")
    if key != key.strip():
        raise UsageError("the key starts or ends with whitespace, which the router strips "
                         "from `Authorization: Bearer <key>`: hash the key without it")
    print(hash_api_key(key))
    return 0


def _deploy(args: argparse.Namespace) -> int:
    config = with_config_folder(read_config(args.config), args.config)
    _dashboard(args.address)
    if not _print_verdict(args.config, *_problems(config, engine=not args.skip_engine_check,
                                                  offline=args.offline or None)):
        return REFUSED_EXIT
    deploy(deployable_copy(args.config), args.address, timeout_s=args.timeout_s)
    print("all applications RUNNING")
    return 0


def _wait(args: argparse.Namespace) -> int:
    names = [a.get("name") for a in applications(read_config(args.config))]
    _dashboard(args.address)
    wait_until_running(args.address, names, {}, timeout_s=args.timeout_s)
    print("all applications RUNNING")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """meshctl's argument parser (every subcommand)."""
    parser = _Parser(prog="meshctl", description=__doc__.split("\n\n")[0],
                     epilog=f"exit status: 0 done, {REFUSED_EXIT} refused (an invalid config, "
                            f"a refused restart, a failed deploy), {USAGE_EXIT} could not run "
                            "(bad arguments, a file that cannot be read or is not YAML, an "
                            "address that does not answer); `rollout status` has its own "
                            "table (see its --help); every command's: docs/ci.md, \"Exit "
                            "codes\"")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check Serve configs of the mesh")
    p.add_argument("configs", nargs="+")
    p.add_argument("--against", metavar="OLD",
                   help="also report changes against OLD (a file, or `live`: the deployed "
                        "config) and refuse those that restart replicas")
    p.add_argument("--allow-restart", action="store_true",
                   help="with --against: accept changes that restart replicas")
    _add_address(p)
    _add_engine_check(p)
    p = sub.add_parser("diff", help="validate NEW, then what it restarts and what it changes "
                                    "in place")
    p.add_argument("old", help="the current config file, or `live` (the deployed config)")
    p.add_argument("new")
    p.add_argument("--fail-on-restart", action="store_true",
                   help="exit 1 when a change restarts replicas")
    _add_address(p)
    _add_engine_check(p)
    for name, help_ in (("deploy", "validate, serve deploy, wait until RUNNING"),
                        ("wait", "wait until the config's applications are RUNNING")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config")
        _add_address(p)
        p.add_argument("--timeout-s", type=float, default=900,
                       help="longest wait for RUNNING, s (default %(default)s)")
        if name == "deploy":
            _add_engine_check(p)
    p = sub.add_parser("swap", help="blue/green release of a route's new base model or "
                                    "engine args")
    p.add_argument("config", help="the Serve config deployed now")
    p.add_argument("--route", required=True, help="the route to move (e.g. smollm)")
    p.add_argument("--new-app", required=True, help="name of the new variant application")
    p.add_argument("--model", help="the new variant's args.model (default: the copied "
                                   "variant's)")
    p.add_argument("--engine-arg", action="append", type=_engine_arg, metavar="KEY=VALUE",
                   help="set one of the new variant's engine args (VALUE is YAML; null "
                        "removes it); repeat for more")
    p.add_argument("--from-app", help="variant application to copy (default: the route's "
                                      "variant with a positive weight)")
    p.add_argument("--steps", default=[100], type=_steps,
                   help="new variant's weight percentages, ending at 100 (default 100)")
    p.add_argument("--pause-s", type=float, default=10,
                   help="seconds to wait after each weight step (default %(default)s)")
    p.add_argument("--emit", metavar="DIR",
                   help="only write the numbered configs to DIR (for CI), apply nothing")
    _add_address(p)
    p.add_argument("--timeout-s", type=float, default=900,
                   help="longest wait for RUNNING per step, s (default %(default)s)")
    _add_engine_check(p)
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
    status = rollout_watch.add_parser(sub)
    status.usage_exit = rollout_watch.USAGE
    parser.subcommands = {("rollout", "status"): status}
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
    p.add_argument("--ingress", choices=sorted(INGRESSES),
                   help="how clients reach the router on each pod: Serve's HTTP proxy or "
                        "Ray's HAProxy (default: $MESH_INGRESS, else "
                        f"{DEFAULT_INGRESS}); its Serve settings go in every pod's env")
    p.add_argument("--overlay", metavar="FLEET_FILE",
                   help="the fleet file merged into the pods: secrets, the cache volume, node "
                        "selectors and tolerations, per accelerator type too "
                        "(docs/gpu-fleet.md, \"The fleet file\"); default: an optional "
                        "Secret NAME-credentials and an emptyDir cache")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"validate": None, "diff": None, "deploy": _deploy, "wait": _wait,
                "swap": _swap, "rollout-report": _rollout_report,
                "rollout": rollout_watch.status_command, "kuberay": _kuberay,
                "top-adapters": _top_adapters, "hash-key": _hash_key}
    try:
        if args.command == "validate":
            if args.allow_restart and not args.against:
                raise UsageError("--allow-restart needs --against OLD")
            engine = not args.skip_engine_check
            code = _validate(args.configs, engine=engine, offline=args.offline or None)
            if code == 0 and args.against:
                codes = [_report(args.against, c, args.address, validate=False,
                                 refuse_restart=not args.allow_restart) for c in args.configs]
                code = max(codes)
            return code
        if args.command == "diff":
            return _report(args.old, args.new, args.address,
                           refuse_restart=args.fail_on_restart,
                           engine=not args.skip_engine_check,
                           offline=args.offline or None)
        return commands[args.command](args)
    except UsageError as e:
        print(f"meshctl {args.command}: {e}", file=sys.stderr)
        return USAGE_EXIT
    except DeployError as e:
        print(f"meshctl {args.command}: {e}", file=sys.stderr)
        return REFUSED_EXIT
    except httpx.HTTPError as e:  # the dashboard went away during a wait
        print(f"meshctl {args.command}: lost the Ray dashboard at {args.address} "
              f"({type(e).__name__}: {_one_line(e)}); check `ray status`, then run the "
              "command again", file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print(f"meshctl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
