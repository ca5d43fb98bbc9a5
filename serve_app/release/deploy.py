"""Apply a Serve config with the real ``serve deploy`` command and wait until it is running.

The command is Ray's own click command (``ray.serve.scripts.cli``), run in this process: the
same config validation and the same REST call as the ``serve`` executable, without starting a
second Python (about 2.7 s per deploy on a 2-core host, most of a deploy's time here).

Status comes from the Ray dashboard's Serve REST API (``GET /api/serve/applications/``), the
same source ``serve status`` reads. Used by the demo, the tests and ``meshctl``.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from serve_app.common.serve_configs import applications, load_yaml

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


class DeployError(RuntimeError):
    """``serve deploy`` failed, an application went DEPLOY_FAILED, or the wait timed out."""


def serve_cli() -> str:
    """The ``serve`` executable of this Python environment."""
    local = Path(sys.executable).parent / "serve"
    return str(local) if local.exists() else (shutil.which("serve") or "serve")


def serve_status(dashboard: str = DEFAULT_DASHBOARD) -> dict[str, Any]:
    """The dashboard's Serve status document (applications, deployments, replicas). 30 s:
    the dashboard is one Python process, slow to answer while a node's cores are busy."""
    r = httpx.get(f"{dashboard}/api/serve/applications/", timeout=30)
    r.raise_for_status()
    return r.json()


def running_replicas(dashboard: str, app: str, deployment: str) -> list[dict[str, Any]]:
    """The RUNNING replicas of ``app``/``deployment``, as Serve details them (``replica_id``,
    ``node_id``, ``pid``, ...)."""
    apps = serve_status(dashboard).get("applications", {})
    return running_in(apps.get(app, {}).get("deployments", {}).get(deployment, {}))


def running_in(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """The RUNNING replicas of one deployment of a Serve status document."""
    return [r for r in deployment.get("replicas", []) if r.get("state") == "RUNNING"]


def replica_ids(dashboard: str, app: str, deployment: str) -> set[str]:
    """Ids of the RUNNING replicas of ``app``/``deployment`` (for restart checks)."""
    return {r["replica_id"] for r in running_replicas(dashboard, app, deployment)}


def deploy(config_path: str | Path, dashboard: str = DEFAULT_DASHBOARD, *,
           wait: bool = True, timeout_s: float = 900,
           log: Callable[[str], None] = print) -> None:
    """Run ``serve deploy -a <dashboard> <config_path>``; optionally wait for RUNNING.

    Raises:
        DeployError: the command refused the config or could not reach the dashboard (its
            message is included), or see :func:`wait_until_running`.
    """
    expected = [a["name"] for a in applications(load_yaml(config_path))]
    before = _deployed_times(dashboard)
    log(f"serve deploy {config_path} -> {dashboard}")
    serve_deploy(config_path, dashboard)
    if wait:
        wait_until_running(dashboard, expected, before, timeout_s=timeout_s, log=log)


def serve_deploy(config_path: str | Path, dashboard: str) -> None:
    """Ray's ``serve deploy`` command, in this process (module docstring).

    Raises:
        DeployError: the command failed; the message is its error and what it printed.
    """
    from ray.serve.scripts import cli  # Ray's own CLI; imported on first use (~2 s)

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            cli.main(["deploy", "-a", dashboard, str(config_path)], prog_name="serve",
                     standalone_mode=False)
    except Exception as e:  # noqa: BLE001 - click, pydantic, connection: all are a refusal
        raise DeployError(f"serve deploy {config_path} failed: {type(e).__name__}: {e}\n"
                          f"{out.getvalue()[-4000:]}".rstrip()) from e


def wait_until_running(dashboard: str, expected: list[str], before: dict[str, float],
                       *, timeout_s: float = 900, log: Callable[[str], None] = print) -> None:
    """Wait until the controller has taken the new config and every expected application is
    RUNNING, and applications not in it are gone. Prints progress every ~10 s.

    Args:
        before: ``last_deployed_time_s`` per application before the deploy.

    Raises:
        DeployError: an application is DEPLOY_FAILED (its message is included), or
            ``timeout_s`` seconds passed.
    """
    deadline = time.monotonic() + timeout_s
    last_log = 0.0
    while True:
        apps = serve_status(dashboard).get("applications", {})
        failed = {n: a.get("message", "") for n, a in apps.items()
                  if a.get("status") == "DEPLOY_FAILED" and n in expected}
        if failed:
            raise DeployError("deploy failed: " + "; ".join(f"{n}: {m}" for n, m in failed.items()))
        taken = all(apps.get(n, {}).get("last_deployed_time_s", 0) > before.get(n, 0)
                    for n in expected)
        pending = {n: apps.get(n, {}).get("status", "MISSING") for n in expected
                   if apps.get(n, {}).get("status") != "RUNNING"}
        leftover = [n for n in apps if n not in expected]
        if taken and not pending and not leftover:
            return
        if time.monotonic() > deadline:
            raise DeployError(f"timed out after {timeout_s:.0f} s waiting for "
                              f"{pending or leftover}")
        if time.monotonic() - last_log > 10:
            state = ", ".join(f"{n}={s}" for n, s in pending.items()) or "taking the new config"
            log(f"  waiting: {state}" + (f"; removing {', '.join(leftover)}" if leftover else ""))
            last_log = time.monotonic()
        time.sleep(0.25)


def _deployed_times(dashboard: str) -> dict[str, float]:
    try:
        apps = serve_status(dashboard).get("applications", {})
    except httpx.HTTPError:
        return {}
    return {n: a.get("last_deployed_time_s", 0) for n, a in apps.items()}


def live_config(dashboard: str) -> dict[str, Any]:
    """The Serve config deployed now, as ``{"applications": [...]}``, from the dashboard's
    ``GET /api/serve/applications/`` (each application's ``deployed_app_config``).

    Raises:
        httpx.HTTPError: the dashboard cannot be reached.
        ValueError: nothing was deployed with a config (``serve deploy``).
    """
    apps = serve_status(dashboard).get("applications") or {}
    configs = [a["deployed_app_config"] for a in apps.values() if a.get("deployed_app_config")]
    if not configs:
        raise ValueError(f"no application at {dashboard} was deployed from a config file "
                         "(serve deploy); there is no live config to compare with")
    return {"applications": configs}


def load_config(source: str, dashboard: str) -> dict[str, Any]:
    """A Serve config from a YAML file, or the deployed one when ``source`` is ``live``.

    Raises:
        ValueError, OSError: see :func:`serve_app.common.serve_configs.load_yaml`.
        httpx.HTTPError, ValueError: see :func:`live_config`.
    """
    return live_config(dashboard) if source == "live" else load_yaml(Path(source))
