"""``meshctl rollout status [--watch]``: follow a progressive rollout until its verdict.

CI deploys a config with a ``rollout:`` (``meshctl deploy``), then blocks on
``meshctl rollout status --watch`` the way ``kubectl argo rollouts status --watch`` blocks on
an Argo rollout: each decision the rollout controller takes is printed as one line when it
happens, and the exit code says how the rollout ended.

The source is the router's ``GET /admin/rollouts`` (an admin tenant's key), polled every
``--interval`` seconds: split key -> ``state``, ``step``, ``weights``, ``policy`` and the
decision ``history`` (:meth:`serve_app.control.rollout.Rollout.to_dict`).

Exit codes (:data:`EXIT_CODES`):

====  ===============  ==========================================================================
code  name             meaning
====  ===============  ==========================================================================
0     ``PROMOTED``     the canary was promoted (weight 100)
1     ``USAGE``        bad arguments, no rollout with that split key, or several rollouts and no
                       ``--split``
2     ``ROLLED_BACK``  a gate failed: the canary went back to weight 0
3     ``ABORTED``      aborted by hand (``abort: true``), or the rollout was removed or replaced
                       by a deploy (``rollout:`` removed, new arms or a new ``id``)
4     ``TIMEOUT``      ``--watch --timeout S``: no verdict within S seconds
5     ``UNREACHABLE``  the router could not be reached (for ``UNREACHABLE_GRACE_S`` while
                       watching), answered 5xx, or refused the admin key (401/403)
6     ``IN_PROGRESS``  without ``--watch``: the rollout is still running (shadowing,
                       progressing or paused)
====  ===============  ==========================================================================

:class:`Watcher` is the pure part (which decisions are new, and the verdict);
:func:`watch` is the poll loop, with an injectable fetch function, clock and sleep.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from serve_app.common.config import RouterConfig
from serve_app.common.serve_configs import load_yaml, mesh_parts
from serve_app.request.split import splits_of
from serve_app.release.rollout_report import fetch_rollouts, figures_text, write_report

PROMOTED, USAGE, ROLLED_BACK, ABORTED, TIMEOUT, UNREACHABLE, IN_PROGRESS = range(7)
#: Exit code -> name, as in the table above.
EXIT_CODES = {PROMOTED: "promoted", USAGE: "usage error", ROLLED_BACK: "rolled back",
              ABORTED: "aborted", TIMEOUT: "timeout", UNREACHABLE: "mesh unreachable",
              IN_PROGRESS: "in progress"}
#: Rollout state -> exit code once it is final.
FINAL = {"promoted": PROMOTED, "rolled_back": ROLLED_BACK, "aborted": ABORTED}

#: Seconds a watch keeps polling through failed reads (router restarting, controller busy)
#: before it gives up with UNREACHABLE; also how long it waits for the split to appear.
UNREACHABLE_GRACE_S = 30.0


class Unreachable(Exception):
    """The router did not answer ``/admin/rollouts``.

    Attributes:
        fatal: retrying cannot help (the key was refused: 401/403).
    """

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


Fetch = Callable[[], dict[str, Any]]


def http_fetch(router_url: str, admin_key: str) -> Fetch:
    """A fetch function for :func:`watch`: ``GET {router_url}/admin/rollouts``.

    The function raises :class:`Unreachable` (``fatal`` on 401/403) instead of httpx's errors.
    """
    def fetch() -> dict[str, Any]:
        try:
            return fetch_rollouts(router_url, admin_key)
        except httpx.HTTPStatusError as e:
            status = e.response.status_code
            raise Unreachable(f"{router_url}/admin/rollouts answered {status}: "
                              f"{e.response.text[:300]}", fatal=status in (401, 403)) from None
        except (httpx.HTTPError, ValueError) as e:  # ValueError: a body that is not JSON
            raise Unreachable(f"cannot read {router_url}/admin/rollouts: "
                              f"{type(e).__name__}: {e}") from None
    return fetch


def decision_line(key: str, d: dict[str, Any]) -> str:
    """One decision as one line: UTC time, split, step (index into ``policy.steps``, as
    ``/admin/rollouts`` counts), decision, weights (percent), reason
    (the gates that failed, or that all held), and the canary's and stable arm's figures."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d["at"]))
    w = d["canary_weight"]
    line = (f"{at} {key} step {d['step']} {d['decision']}: canary {w}% / stable {100 - w}%; "
            f"{d['reason']}; canary {figures_text(d['canary'])}; "
            f"stable {figures_text(d['stable'])}")
    shadow = d.get("shadow")
    if shadow and (d["decision"] == "shadow-pass" or d["reason"].startswith("shadow phase")):
        agreement = "-" if shadow["agreement"] is None else f"{shadow['agreement']:.0%}"
        line += f"; shadow {shadow['compared']} compared, agreement {agreement}"
    return line


def state_line(r: dict[str, Any]) -> str:
    """The rollout's state now, one line."""
    return (f"{r['key']}: {r['state']} (rollout {r['policy']['id']!r}, step {r['step']} of "
            f"steps {r['policy']['steps']}); weights "
            + ", ".join(f"{arm} {w}%" for arm, w in r["weights"].items()))


@dataclass
class Update:
    """What one snapshot told a :class:`Watcher`.

    Attributes:
        lines: what to print, in order (new decisions, notes).
        code: the exit code when the watch is over (a final state, or the rollout gone or
            replaced); None while it runs.
        rollout: the watched rollout in this snapshot (None when it is not there).
    """

    lines: list[str] = field(default_factory=list)
    code: int | None = None
    rollout: dict[str, Any] | None = None


class Watcher:
    """Follows one split's rollout through successive ``/admin/rollouts`` snapshots.

    The first snapshot that has the rollout pins its identity (``policy.id``, arms); a later
    snapshot without the split, or with another identity, ends the watch with ABORTED. A
    rollout restarted with the same identity (a new ``started_at``: its history starts over)
    is followed on from its new history.

    Args:
        split: the split key to follow; None: the only rollout there is.
        expect_id: the ``rollout.id`` the deploy being followed declares: until the split's
            rollout has it, the rollout the mesh ran before is not taken for this one.
    """

    def __init__(self, split: str | None = None, expect_id: str | None = None) -> None:
        self.split = split
        self.expect_id = expect_id
        self.identity: tuple[str, str, str] | None = None
        self.started_at: float | None = None
        self.seen = 0  # decisions of the history already reported
        self.last: dict[str, Any] | None = None  # the rollout in the last snapshot with it

    def pick(self, snapshot: dict[str, Any]) -> tuple[str | None, str | None]:
        """The split key to follow in ``snapshot``, or None with the reason."""
        if self.split is not None:
            return (self.split, None) if self.split in snapshot else (
                None, f"no rollout of split {self.split!r} (rollouts: "
                      f"{', '.join(snapshot) or 'none'})")
        if len(snapshot) == 1:
            return next(iter(snapshot)), None
        return None, (f"{len(snapshot)} rollouts ({', '.join(snapshot)}): choose one with "
                      f"--split" if snapshot else "no rollout is running")

    def update(self, snapshot: dict[str, Any]) -> Update:
        """Take one snapshot; return the lines to print and, when over, the exit code."""
        if self.identity is None:
            key, why = self.pick(snapshot)
            if key is None:
                return Update([why], USAGE)
            self.split = key
        r = snapshot.get(self.split)
        if r is None:
            return Update([f"{self.split}: the rollout is gone (its `rollout:` was removed "
                           "by a deploy): aborted"], ABORTED)
        if (self.identity is None and self.expect_id is not None
                and r["policy"]["id"] != self.expect_id):
            return Update([f"{self.split}: the mesh runs rollout {r['policy']['id']!r}, not "
                           f"{self.expect_id!r} of the deployed config"], USAGE)
        identity = (r["policy"]["id"], r["stable"], r["canary"])
        if self.identity is not None and identity != self.identity:
            return Update([f"{self.split}: replaced by a deploy: rollout {identity[0]!r} of "
                           f"{identity[2]} against {identity[1]} instead of "
                           f"{self.identity[0]!r} of {self.identity[2]}: aborted"], ABORTED)
        up = Update(rollout=r)
        if self.started_at is not None and r["started_at"] != self.started_at:
            up.lines.append(f"{self.split}: the rollout started again from its first step")
            self.seen = 0
        self.identity, self.started_at, self.last = identity, r["started_at"], r
        up.lines += [decision_line(self.split, d) for d in r["history"][self.seen:]]
        self.seen = len(r["history"])
        up.code = FINAL.get(r["state"])
        return up


def declared_rollouts(config: dict[str, Any]) -> dict[str, str]:
    """Split key -> ``rollout.id`` of each progressive rollout a Serve config declares.

    Raises:
        pydantic.ValidationError: the config's router ``user_config`` is invalid.
    """
    user_config = mesh_parts(config).router_user_config or {}
    return {key: split.rollout.id for key, split in
            splits_of(RouterConfig.model_validate(user_config)).items() if split.rollout}


def watch(fetch: Fetch, *, split: str | None = None, expect_id: str | None = None,
          follow: bool = True,
          timeout_s: float | None = None, interval_s: float = 2.0,
          grace_s: float = UNREACHABLE_GRACE_S, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep, out: Callable[[str], None] = print
          ) -> tuple[int, dict[str, Any] | None]:
    """Poll ``fetch`` until the rollout's verdict (``follow``), or read it once.

    Args:
        fetch: returns an ``/admin/rollouts`` snapshot; raises :class:`Unreachable`.
        split: the split key (None: the only rollout).
        expect_id: see :class:`Watcher`.
        follow: poll until a verdict (``--watch``); else one read, ending in IN_PROGRESS
            when the rollout runs.
        timeout_s: give up with TIMEOUT after this many seconds (None: never).
        interval_s: seconds between two reads.
        grace_s: failed reads, or a split not (yet) there, are retried this many seconds.
        clock, sleep: monotonic seconds and a sleep, for tests.
        out: where the lines go.

    Returns:
        The exit code and the last snapshot of the rollout (None if never seen).
    """
    watcher = Watcher(split, expect_id)
    start = clock()
    failing_since: float | None = None
    while True:
        try:
            up = watcher.update(fetch())
            failing_since = None
        except Unreachable as e:
            now = clock()
            if not follow or e.fatal or (failing_since is not None
                                          and now - failing_since >= grace_s):
                out(f"cannot follow the rollout: {e}")
                return UNREACHABLE, watcher.last
            if failing_since is None:
                failing_since = now
                out(f"{e}; retrying for up to {grace_s:g} s")
            up = Update()
        if up.code == USAGE and follow and clock() - start < grace_s:
            up = Update()  # just deployed: the router may not have the rollout yet
        for line in up.lines:
            out(line)
        if up.code is not None:
            if up.rollout is not None:
                out(state_line(up.rollout))
            return up.code, watcher.last
        if not follow:
            if watcher.last is not None:
                out(state_line(watcher.last))
            return IN_PROGRESS, watcher.last
        if timeout_s is not None and clock() - start >= timeout_s:
            out(f"timed out after {timeout_s:g} s without a verdict"
                + (f"; {state_line(watcher.last)}" if watcher.last else ""))
            return TIMEOUT, watcher.last
        sleep(interval_s)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``rollout status`` to meshctl's subcommands (``sub``: argparse's subparsers);
    return its parser."""
    status = sub.add_parser("rollout", help="follow progressive rollouts").add_subparsers(
        dest="rollout_command", required=True).add_parser(
        "status", help="a rollout's state, or --watch it until its verdict",
        description="Print a progressive rollout's decisions and state (GET /admin/rollouts); "
                    "with --watch, follow it until it is promoted, rolled back or aborted.",
        epilog="exit codes: " + ", ".join(f"{c} {n}" for c, n in EXIT_CODES.items()))
    add_arguments(status)
    return status


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``meshctl rollout status``."""
    p.add_argument("--watch", action="store_true",
                   help="follow the rollout until it is promoted, rolled back or aborted")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="with --watch: exit 4 after S seconds without a verdict")
    p.add_argument("--split", help="the rollout's split key (a route, or route:adapter); "
                                   "default: the only rollout")
    p.add_argument("--config", metavar="CONFIG",
                   help="the Serve config just deployed: follow the rollout it declares, "
                        "and wait until the mesh runs that one (its rollout.id)")
    p.add_argument("--report", metavar="DIR",
                   help="at the end, write the rollout report (PNG + Markdown) into DIR")
    p.add_argument("--interval", type=float, default=2.0, metavar="S",
                   help="seconds between two reads (default %(default)s)")
    p.add_argument("--router-url", default=os.environ.get("MESH_ROUTER_URL",
                                                          "http://127.0.0.1:8000"),
                   help="the mesh's HTTP address (default: $MESH_ROUTER_URL or %(default)s)")
    p.add_argument("--admin-key", default=os.environ.get("MESH_ADMIN_KEY", ""),
                   help="an admin tenant's API key (default: $MESH_ADMIN_KEY)")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090",
                   help="Prometheus for the report's figures over time; '' to go without")


def _config_error(e: Exception) -> str:
    from pydantic import ValidationError

    from serve_app.common.errors import format_validation_error

    if isinstance(e, ValidationError):
        return ("the router's user_config is invalid: "
                + "; ".join(format_validation_error(e).splitlines())
                + " (meshctl validate says more)")
    if isinstance(e, OSError):
        return f"cannot read it: {e.strerror or e}"
    return str(e)


def status_command(args: argparse.Namespace) -> int:
    """``meshctl rollout status``: see the module docstring for the exit codes."""
    if (args.timeout is not None and args.timeout <= 0) or args.interval <= 0:
        print("meshctl rollout status: --timeout and --interval must be > 0", file=sys.stderr)
        return USAGE
    split, expect_id = args.split, None
    if args.config:
        try:
            declared = declared_rollouts(load_yaml(args.config))
        except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            print(f"meshctl rollout status: --config {args.config}: "
                  + " ".join(_config_error(e).split()), file=sys.stderr)
            return USAGE
        if split is None and len(declared) == 1:
            split = next(iter(declared))
        if split not in declared:
            print(f"meshctl rollout status: {args.config} declares no rollout"
                  + (f" of split {split!r}" if split else "") + f" (it declares: "
                  f"{', '.join(declared) or 'none'})", file=sys.stderr)
            return USAGE
        expect_id = declared[split]
    code, rollout = watch(http_fetch(args.router_url, args.admin_key), split=split,
                          expect_id=expect_id, follow=args.watch, timeout_s=args.timeout, interval_s=args.interval,
                          out=lambda line: print(line, flush=True))
    if args.report and rollout is not None:
        try:
            report = write_report(rollout, Path(args.report), args.prometheus or None)
            print(f"wrote {report.png} and {report.markdown}")
        except Exception as e:  # noqa: BLE001 -- the exit code is the verdict, not the report's
            print(f"meshctl rollout status: the report could not be written "
                  f"({type(e).__name__}: {e}); the verdict stands", file=sys.stderr)
    print(f"exit {code} ({EXIT_CODES[code]})", flush=True)
    return code
