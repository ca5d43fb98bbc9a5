"""What every ``meshctl`` command shares: the exit statuses, :class:`UsageError`, the argument
parser's class, reading a config file, reaching the Ray dashboard, and the options several
commands take (``-a``, ``--skip-engine-check``, ``--offline``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import httpx
import yaml

from serve_app.common.serve_configs import load_yaml
from serve_app.release.deploy import DEFAULT_DASHBOARD, live_config, serve_status
from serve_app.release.engine_check import VLLM_IMPORT_TIME
from serve_app.release.manifest_paths import with_config_folder

#: Exit status of a command that cannot do its job: bad arguments, a file that cannot be
#: read or is not YAML, an address that does not answer (argparse's own code for bad
#: arguments). ``rollout status`` keeps its own table (:data:`rollout_watch.EXIT_CODES`).
USAGE_EXIT = 2
#: Exit status of a verdict of no: an invalid config, a refused restart, a failed deploy.
REFUSED_EXIT = 1


class UsageError(Exception):
    """A command cannot run as asked; the message is one line that says how to fix it."""


class MeshctlParser(argparse.ArgumentParser):
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


def one_line(text: str) -> str:
    """``text`` (or an exception's message) on one line, runs of whitespace made one space."""
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
        raise UsageError(one_line(e)) from None


def read_yaml(path: str) -> Any:
    """A YAML file's content (None for an empty one).

    Raises:
        UsageError: the file is missing, unreadable or not YAML.
    """
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{path} is not YAML: {one_line(e)}") from None


def dashboard(address: str) -> dict[str, Any]:
    """The dashboard's Serve status, or a UsageError that says where Ray was looked for."""
    try:
        return serve_status(address)
    except (httpx.HTTPError, ValueError) as e:
        raise UsageError(f"cannot reach the Ray dashboard at {address} ({type(e).__name__}: "
                         f"{one_line(e) or 'no answer'}); is Ray running (`ray status`)? "
                         "pass its address with -a or $RAY_DASHBOARD_ADDRESS") from None


def config_or_live(source: str, address: str) -> dict[str, Any]:
    """A config file, or ``live``: the config deployed now on the cluster at ``address``."""
    if source != "live":
        return with_config_folder(read_config(source), source)
    dashboard(address)
    try:
        return live_config(address)
    except (httpx.HTTPError, ValueError) as e:
        raise UsageError(f"live: {one_line(e)}") from None


def add_address(p: argparse.ArgumentParser) -> None:
    """``-a/--address``: the Ray dashboard (default ``$RAY_DASHBOARD_ADDRESS``)."""
    p.add_argument("-a", "--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS",
                                                              DEFAULT_DASHBOARD),
                   help="Ray dashboard address (default: $RAY_DASHBOARD_ADDRESS or "
                        f"{DEFAULT_DASHBOARD})")


def add_engine_check(p: argparse.ArgumentParser) -> None:
    """``--skip-engine-check`` and ``--offline``: how far vLLM's checks of the engine args
    go."""
    p.add_argument("--skip-engine-check", action="store_true",
                   help="skip vLLM's checks of the variants' engine args (they import vLLM: "
                        f"{VLLM_IMPORT_TIME}); the replica still runs them when it starts")
    p.add_argument("--offline", action="store_true",
                   help="read no model's config.json from the hub or a bucket (also under "
                        "HF_HUB_OFFLINE=1): engine args are checked without the models not "
                        "on this host, and a warning names the checks left out")
