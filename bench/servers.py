"""Start-up of servers the benchmarks, tests and scripts run beside the mesh (a local Ray
cluster, Redis, vLLM's own server, Prometheus): a free port, and each server started and
answering."""

from __future__ import annotations

import random
import socket
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


#: Where :func:`free_port` looks: below Linux's ephemeral range (32768-60999), which Ray's own
#: processes draw from with every bind to port 0, so a port picked here and bound a moment
#: later is not already taken by one of them (seen: the fallback proxy's port, taken, kept
#: HAProxy with no backup server for a whole test session); above Ray's worker ports
#: (10002-19999) and below Serve's direct-ingress ports (30000 and up).
PORT_RANGE = range(20000, 30000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now: a random one of :data:`PORT_RANGE`, else one
    the OS picks."""
    for port in random.sample(PORT_RANGE, 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def side_cluster_ports() -> dict[str, str]:
    """Free ports for the fixed ports of the mesh's Serve settings
    (:data:`~serve_app.common.serve_env.FIXED_PORT_VARS`), as environment variables: a
    cluster started with them runs beside another on this host."""
    from serve_app.common.serve_env import FIXED_PORT_VARS

    return {var: str(free_port()) for var in FIXED_PORT_VARS}


def start_local_ray(env: dict[str, str] | None = None) -> tuple[str, int, str]:
    """Start a new local Ray cluster for a benchmark (loopback only, the mesh's Serve
    settings overridden by ``env``, free ports for their fixed ones, token auth off as in the
    tests): returns (dashboard URL, a free port for Serve's HTTP proxy, the metrics export
    URL). Stop it with ``ray.shutdown()``."""
    import os

    import ray

    from serve_app.common.serve_env import SERVE_ENV

    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.update({**SERVE_ENV, **side_cluster_ports(), **(env or {})})
    dash, http_port, metrics_port = free_port(), free_port(), free_port()
    # address="local": a new cluster even when `ray start` left /tmp/ray/ray_current_cluster.
    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=dash, configure_logging=False, log_to_driver=False,
             _metrics_export_port=metrics_port)
    return f"http://127.0.0.1:{dash}", http_port, f"http://127.0.0.1:{metrics_port}/metrics"


def start_redis(data_dir: str, port: int | None = None, timeout_s: float = 20.0
                ) -> tuple[subprocess.Popen, str]:
    """Start a ``redis-server`` on 127.0.0.1 that keeps its data in ``data_dir``
    (``appendonly yes``, ``appendfsync always``: what it acknowledged survives its kill, as
    the tenant ledger needs), and wait until it answers ``PING``. Returns the process and its
    ``redis://`` URL. Started again on the same ``data_dir`` and port, it reads its data back.

    Raises:
        ServerDidNotStart: ``redis-server`` is missing (``scripts/install_services.sh``),
            exited, or did not answer in ``timeout_s``.
    """
    import os
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise ServerDidNotStart("redis-server is not installed; run ./scripts/install_services.sh")
    port = port or free_port()
    log_path = os.path.join(data_dir, "redis.log")
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", data_dir,
                             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                             "--logfile", log_path], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    wait_until_ready(proc, url, what="redis-server", log_path=log_path, timeout_s=timeout_s,
                     every_s=0.1, ready=lambda: redis.Redis.from_url(url, socket_timeout=1).ping(),
                     errors=(redis.RedisError,))
    return proc, url
