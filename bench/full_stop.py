"""Stop everything the demo and the guides start on this host, and say what is still running
(``scripts/stop.sh``).

In order:

1. the Serve applications (``serve shutdown -y``): the router lets its requests finish;
2. the tenant counts actor (:data:`serve_app.tenancy.ledger.SHARED_NAME`), which is detached
   and outlives ``serve shutdown`` (``ray kill-actor --force --no-restart``: Ray would
   restart it otherwise);
3. the Prometheus of ``scripts/observability.sh`` (its pid file; SIGTERM, then SIGKILL after
   30 s);
4. Ray on this node (``ray stop``), unless ``--keep-ray``.

Then it lists what is left: Ray's processes of this user (as ``ray stop`` finds them), the
Prometheus, and listeners on the demo's ports (:data:`PORTS`). Exit status 0 when nothing is
left, 1 otherwise (each leftover on its own line, with its pid).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: The demo's ports on this host: what each one is.
PORTS = {8000: "Serve HTTP (the mesh)", 8265: "Ray dashboard", 6379: "Ray GCS",
         8080: "Ray metrics export", 9090: "Prometheus (scripts/observability.sh)",
         10001: "Ray client server"}
#: Where ``scripts/observability.sh`` keeps its Prometheus's pid (its default --data-dir).
PROMETHEUS_PID_FILE = Path("/tmp/mesh-prometheus/prometheus.pid")


def _run(argv: list[str], what: str, timeout_s: float = 120) -> None:
    """Run one stop command; print one line on how it went (a failure is not fatal: the
    thing may not be running)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"[stop] {what}: {type(e).__name__}: {e}")
        return
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    state = "done" if proc.returncode == 0 else f"exit {proc.returncode}"
    print(f"[stop] {what}: {state}{': ' + last[0][:200] if last[0] else ''}")


def _bin(name: str) -> str:
    """An executable of this Python environment (``serve``, ``ray``), else the PATH's."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def stop_prometheus(pid_file: Path = PROMETHEUS_PID_FILE, timeout_s: float = 30) -> str:
    """Stop the Prometheus whose pid ``pid_file`` holds; return what happened, one line."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return f"no pid file {pid_file}: not running"
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        return f"pid {pid} was not running"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return f"stopped pid {pid}"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ray_processes() -> list[tuple[int, str]]:
    """(pid, command) of this user's Ray processes, found as ``ray stop`` finds them."""
    import psutil
    from ray.autoscaler._private.constants import RAY_PROCESSES

    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "uids"]):
        try:
            if proc.info["uids"] is not None and proc.info["uids"].real != os.getuid():
                continue
            name, args = proc.info["name"] or "", " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for keyword, by_name in RAY_PROCESSES:
            if (keyword in name[:15]) if by_name else (keyword in args):
                found.append((proc.info["pid"], (args or name)[:120]))
                break
    return found


def listeners(ports: dict[int, str] = PORTS) -> list[tuple[int, str]]:
    """(port, what it is) of the ports in ``ports`` that something listens on."""
    import socket

    taken = []
    for port, what in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                taken.append((port, what))
    return taken


def leftovers(*, keep_ray: bool = False, pid_file: Path = PROMETHEUS_PID_FILE) -> list[str]:
    """What still runs, one line each (empty: nothing). With ``keep_ray``, Ray's own
    processes and ports are not counted."""
    lines = []
    if not keep_ray:
        lines += [f"Ray process pid {pid}: {cmd}" for pid, cmd in ray_processes()]
    if pid_file.exists():
        lines.append(f"Prometheus: {pid_file} is still there")
    ray_ports = {8265, 6379, 8080, 10001}
    lines += [f"port {port} ({what}) is in use"
              for port, what in listeners() if not (keep_ray and port in ray_ports)]
    return lines


def main() -> int:
    from bench.script_args import script_parser
    from serve_app.release.deploy import DEFAULT_DASHBOARD
    from serve_app.tenancy.ledger import SHARED_NAME, SHARED_NAMESPACE

    p = script_parser(__doc__, prog="stop.sh")
    p.add_argument("--keep-ray", action="store_true",
                   help="stop the mesh, its counts actor and Prometheus, but leave Ray running")
    p.add_argument("-a", "--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS",
                                                              DEFAULT_DASHBOARD),
                   help="the Ray dashboard (serve shutdown)")
    p.add_argument("--prometheus-pid-file", type=Path, default=PROMETHEUS_PID_FILE,
                   help="the pid file of scripts/observability.sh's Prometheus")
    a = p.parse_args()
    _run([_bin("serve"), "shutdown", "-y", "-a", a.address], "serve shutdown")
    _run([_bin("ray"), "kill-actor", "--name", SHARED_NAME, "--namespace", SHARED_NAMESPACE,
          "--force", "--no-restart"], f"tenant counts actor {SHARED_NAME}")
    print(f"[stop] Prometheus: {stop_prometheus(a.prometheus_pid_file)}")
    if not a.keep_ray:
        _run([_bin("ray"), "stop"], "ray stop")
    left = leftovers(keep_ray=a.keep_ray, pid_file=a.prometheus_pid_file)
    for line in left:
        print(f"[stop] STILL RUNNING: {line}")
    print("[stop] nothing left running" if not left else
          f"[stop] {len(left)} thing(s) still running (see above)")
    return 1 if left else 0


if __name__ == "__main__":
    from bench.script_args import run

    run(main)
