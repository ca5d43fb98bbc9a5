"""``meshctl deploy``, ``wait`` and ``swap``: put a config on the cluster (validated first)
and wait until its applications are RUNNING; release a route's new base model or engine args
blue/green (:mod:`serve_app.release.swap`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from serve_app.commands.base import (REFUSED_EXIT, UsageError, add_address, add_engine_check,
                                     dashboard, read_config)
from serve_app.commands.check import config_problems, print_verdict
from serve_app.common.serve_configs import applications
from serve_app.release.deploy import deploy, wait_until_running
from serve_app.release.manifest_paths import deployable_copy, with_config_folder
from serve_app.release.swap import InvalidPlan, apply_plan, parse_steps, plan_swap, write_plan


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


def swap_command(args: argparse.Namespace) -> int:
    """``meshctl swap``: 0 released (or, with ``--emit``, written), 1 the plan or the new
    variant's engine args are invalid.

    Raises:
        UsageError: neither ``--model`` nor ``--engine-arg``; arguments that do not fit the
            config; the config cannot be read; the dashboard does not answer.
        DeployError: a step failed or timed out.
    """
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
        dashboard(args.address)
        apply_plan(plan, args.address, pause_s=args.pause_s, timeout_s=args.timeout_s)
    return 0


def deploy_command(args: argparse.Namespace) -> int:
    """``meshctl deploy``: 0 every application RUNNING, 1 the config is invalid.

    Raises:
        UsageError: the config cannot be read; the dashboard does not answer.
        DeployError: ``serve deploy`` failed, or RUNNING did not come in ``--timeout-s``.
    """
    config = with_config_folder(read_config(args.config), args.config)
    dashboard(args.address)
    if not print_verdict(args.config, *config_problems(
            config, engine=not args.skip_engine_check, offline=args.offline or None)):
        return REFUSED_EXIT
    deploy(deployable_copy(args.config), args.address, timeout_s=args.timeout_s)
    print("all applications RUNNING")
    return 0


def wait_command(args: argparse.Namespace) -> int:
    """``meshctl wait``: 0 every application of the config RUNNING.

    Raises:
        UsageError: the config cannot be read; the dashboard does not answer.
        DeployError: RUNNING did not come in ``--timeout-s``.
    """
    names = [a.get("name") for a in applications(read_config(args.config))]
    dashboard(args.address)
    wait_until_running(args.address, names, {}, timeout_s=args.timeout_s)
    print("all applications RUNNING")
    return 0


def add_deploy_and_wait(sub) -> None:
    """Add ``deploy`` and ``wait`` to meshctl's subcommands (``sub``: argparse's
    subparsers)."""
    for name, help_ in (("deploy", "validate, serve deploy, wait until RUNNING"),
                        ("wait", "wait until the config's applications are RUNNING")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config")
        add_address(p)
        p.add_argument("--timeout-s", type=float, default=900,
                       help="longest wait for RUNNING, s (default %(default)s)")
        if name == "deploy":
            add_engine_check(p)


def add_swap(sub) -> None:
    """Add ``swap`` to meshctl's subcommands (``sub``: argparse's subparsers)."""
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
    add_address(p)
    p.add_argument("--timeout-s", type=float, default=900,
                   help="longest wait for RUNNING per step, s (default %(default)s)")
    add_engine_check(p)
