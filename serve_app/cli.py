"""``meshctl``: the mesh's command line (also ``python -m serve_app.cli``).

    meshctl validate CONFIG...        check Serve configs before `serve deploy` (exit 1 if bad)
    meshctl deploy CONFIG [-a URL]    validate, `serve deploy`, wait until RUNNING
    meshctl wait CONFIG [-a URL]      wait until the applications of CONFIG are RUNNING
    meshctl hash-key [KEY]            SHA-256 of an API key for tenants[].api_keys_sha256
                                      (reads the key from stdin when not given)
"""

from __future__ import annotations

import argparse
import os
import sys

from serve_app.deploy import DEFAULT_DASHBOARD, DeployError, deploy, wait_until_running
from serve_app.serve_configs import applications, load_yaml
from serve_app.tenancy import hash_api_key
from serve_app.validate import validate_config


def _validate(paths: list[str]) -> bool:
    ok = True
    for path in paths:
        try:
            problems = validate_config(load_yaml(path))
        except (OSError, ValueError) as e:
            problems = [str(e)]
        if problems:
            ok = False
            print(f"{path}: INVALID", file=sys.stderr)
            for p in problems:
                for line in p.splitlines():
                    print(f"  {line}", file=sys.stderr)
        else:
            print(f"{path}: ok")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshctl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check Serve configs of the mesh")
    p.add_argument("configs", nargs="+")
    for name, help_ in (("deploy", "validate, serve deploy, wait until RUNNING"),
                        ("wait", "wait until the config's applications are RUNNING")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config")
        p.add_argument("-a", "--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS",
                                                                  DEFAULT_DASHBOARD),
                       help="Ray dashboard address (default %(default)s)")
        p.add_argument("--timeout-s", type=float, default=900)
    p = sub.add_parser("hash-key", help="print the SHA-256 digest of an API key")
    p.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    args = parser.parse_args(argv)

    if args.command == "hash-key":
        print(hash_api_key(args.key if args.key is not None else sys.stdin.readline().strip()))
        return 0
    if args.command == "validate":
        return 0 if _validate(args.configs) else 1
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
