"""``meshctl validate`` and ``meshctl diff``: a config's verdict (the mesh's checks, then
vLLM's of the engine args), and what a new config restarts or changes in place against the
old one (a file, or ``live``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

import yaml

from serve_app.commands.base import (REFUSED_EXIT, USAGE_EXIT, UsageError, add_address,
                                     add_engine_check, config_or_live, read_config)
from serve_app.common.serve_configs import mesh_parts
from serve_app.release.change_lines import report_lines
from serve_app.release.config_diff import diff_configs, restarts
from serve_app.release.engine_check import VLLM_IMPORT_TIME
from serve_app.release.manifest_paths import with_config_folder
from serve_app.release.validate import config_warnings, validate_config


def config_problems(config: dict[str, Any], *, engine: bool,
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


def print_verdict(path: str, problems: list[str], warnings: list[str]) -> bool:
    """Print a config's warnings and problems (stderr), or ``PATH: ok`` (stdout); True when
    it has no problems."""
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
        if not print_verdict(path, *config_problems(config, engine=engine, offline=offline)):
            code = code or REFUSED_EXIT
    return code


def _report(old: str, new: str, address: str, *, refuse_restart: bool,
            validate: bool = True, engine: bool = True, offline: bool | None = None) -> int:
    """Print the change report of ``new`` against ``old`` (a file or ``live``), after
    validating ``new`` (``validate``). Returns 1 when ``new`` is invalid, or when
    ``refuse_restart`` and a change restarts replicas (each one explained on stderr)."""
    new_config = with_config_folder(read_config(new), new)
    old_config = config_or_live(old, address)
    if validate and not print_verdict(new, *config_problems(new_config, engine=engine,
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
        print(blue_green_hint(old, new_config, restarting), file=sys.stderr)
        return REFUSED_EXIT
    return 0


def blue_green_hint(old: str, new_config: dict[str, Any], restarting) -> str:
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


def validate_command(args: argparse.Namespace) -> int:
    """``meshctl validate CONFIG... [--against OLD|live [--allow-restart]]``: 0 all valid
    (and no refused restart), 1 refused, 2 a file cannot be read.

    Raises:
        UsageError: ``--allow-restart`` without ``--against``; OLD cannot be read.
    """
    if args.allow_restart and not args.against:
        raise UsageError("--allow-restart needs --against OLD")
    engine = not args.skip_engine_check
    code = _validate(args.configs, engine=engine, offline=args.offline or None)
    if code == 0 and args.against:
        codes = [_report(args.against, c, args.address, validate=False,
                         refuse_restart=not args.allow_restart) for c in args.configs]
        code = max(codes)
    return code


def diff_command(args: argparse.Namespace) -> int:
    """``meshctl diff OLD|live NEW [--fail-on-restart]``: 0 reported, 1 NEW is invalid or
    (``--fail-on-restart``) restarts replicas.

    Raises:
        UsageError: a file cannot be read, or the dashboard does not answer (``live``).
    """
    return _report(args.old, args.new, args.address,
                   refuse_restart=args.fail_on_restart,
                   engine=not args.skip_engine_check,
                   offline=args.offline or None)


def add_validate(sub) -> None:
    """Add ``validate`` to meshctl's subcommands (``sub``: argparse's subparsers)."""
    p = sub.add_parser("validate", help="check Serve configs of the mesh")
    p.add_argument("configs", nargs="+")
    p.add_argument("--against", metavar="OLD",
                   help="also report changes against OLD (a file, or `live`: the deployed "
                        "config) and refuse those that restart replicas")
    p.add_argument("--allow-restart", action="store_true",
                   help="with --against: accept changes that restart replicas")
    add_address(p)
    add_engine_check(p)


def add_diff(sub) -> None:
    """Add ``diff`` to meshctl's subcommands (``sub``: argparse's subparsers)."""
    p = sub.add_parser("diff", help="validate NEW, then what it restarts and what it changes "
                                    "in place")
    p.add_argument("old", help="the current config file, or `live` (the deployed config)")
    p.add_argument("new")
    p.add_argument("--fail-on-restart", action="store_true",
                   help="exit 1 when a change restarts replicas")
    add_address(p)
    add_engine_check(p)
