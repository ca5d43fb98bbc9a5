"""Waiting for a server process a command starts (Prometheus for ``scripts/observability.sh``,
vLLM's own server and Redis for the benchmarks and tests) until it answers."""

from __future__ import annotations

import subprocess
import time

import httpx


class ServerDidNotStart(RuntimeError):
    """The process exited, or did not answer in time (the message says which and where its
    log is)."""


def wait_until_ready(proc: subprocess.Popen, url: str, *, what: str, log_path: str,
                     timeout_s: float, every_s: float = 1.0, ready=None,
                     errors: tuple[type[Exception], ...] = (httpx.HTTPError,)) -> None:
    """Poll ``url`` until it answers 200 (or ``ready()`` is true; ``errors`` it may raise
    mean "not yet") while ``proc`` runs.

    Raises:
        ServerDidNotStart: ``proc`` exited, or ``timeout_s`` passed (``proc`` is killed).
    """
    ready = ready or (lambda: httpx.get(url, timeout=2).status_code == 200)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerDidNotStart(f"{what} exited; see {log_path}")
        try:
            if ready():
                return
        except errors:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise ServerDidNotStart(f"{what} did not answer {url} in {timeout_s:.0f} s; see "
                                    f"{log_path}")
        time.sleep(every_s)
