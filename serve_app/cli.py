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
import sys

import httpx

from serve_app.commands.base import (REFUSED_EXIT, USAGE_EXIT, MeshctlParser, UsageError,
                                     one_line, read_config)
from serve_app.commands.check import add_diff, add_validate, diff_command, validate_command
from serve_app.commands.deploys import (add_deploy_and_wait, add_swap, deploy_command,
                                        swap_command, wait_command)
from serve_app.commands.keys import add_hash_key, hash_key_command
from serve_app.commands.observe import (add_rollout_report, add_top_adapters,
                                        rollout_report_command, top_adapters_command)
from serve_app.commands.rayservice import add_kuberay, kuberay_command
from serve_app.release import rollout_watch
from serve_app.release.deploy import DeployError

__all__ = ["REFUSED_EXIT", "USAGE_EXIT", "UsageError", "read_config", "build_parser", "main"]

#: subcommand -> the function that runs it (``args`` -> exit status)
COMMANDS = {"validate": validate_command, "diff": diff_command, "deploy": deploy_command,
            "wait": wait_command, "swap": swap_command,
            "rollout-report": rollout_report_command, "rollout": rollout_watch.status_command,
            "kuberay": kuberay_command, "top-adapters": top_adapters_command,
            "hash-key": hash_key_command}


def build_parser() -> argparse.ArgumentParser:
    """meshctl's argument parser (every subcommand)."""
    parser = MeshctlParser(prog="meshctl", description=__doc__.split("\n\n")[0],
                           epilog=f"exit status: 0 done, {REFUSED_EXIT} refused (an invalid "
                                  "config, a refused restart, a failed deploy), "
                                  f"{USAGE_EXIT} could not run (bad arguments, a file that "
                                  "cannot be read or is not YAML, an address that does not "
                                  "answer); `rollout status` has its own table (see its "
                                  "--help); every command's: docs/ci.md, \"Exit codes\"")
    sub = parser.add_subparsers(dest="command", required=True)
    add_validate(sub)
    add_diff(sub)
    add_deploy_and_wait(sub)
    add_swap(sub)
    add_rollout_report(sub)
    status = rollout_watch.add_parser(sub)
    status.usage_exit = rollout_watch.USAGE
    parser.subcommands = {("rollout", "status"): status}
    add_kuberay(sub)
    add_top_adapters(sub)
    add_hash_key(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``meshctl`` on ``argv`` (default: ``sys.argv[1:]``); return its exit status
    (module docstring; ``rollout status``: :data:`rollout_watch.EXIT_CODES`)."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"meshctl {args.command}: {e}", file=sys.stderr)
        return USAGE_EXIT
    except DeployError as e:
        print(f"meshctl {args.command}: {e}", file=sys.stderr)
        return REFUSED_EXIT
    except httpx.HTTPError as e:  # the dashboard went away during a wait
        print(f"meshctl {args.command}: lost the Ray dashboard at {args.address} "
              f"({type(e).__name__}: {one_line(e)}); check `ray status`, then run the "
              "command again", file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print(f"meshctl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
