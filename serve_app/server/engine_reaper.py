"""No vLLM engine outlives its replica.

vLLM runs its engine core in child processes of the replica (``EngineCore``, and on some
backends a ``Worker``). A replica that stops normally shuts them down, and vLLM cleans them up
after a ``kill -9`` of the replica alone. But when the node's Ray processes die together
(``ray stop --force``, a crashed raylet), they were left running as orphans: about 3.5 GB of
memory per engine here, and a GPU's memory on a GPU node, so the next replica cannot start.

:func:`start_reaper` starts a small watcher process beside the replica, in a session of its
own so that signals meant for the replica's process group miss it. Every :data:`POLL_S` it
lists the replica's descendant processes. Once the replica process is gone it stops the
descendants it last saw (SIGTERM, then SIGKILL after :data:`GRACE_S`), then exits. Processes
are matched by pid and start time, so a reused pid is never hit. Run it by hand with
``python -m serve_app.server.engine_reaper REPLICA_PID``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

#: Seconds between two looks at the replica and its descendants.
POLL_S = 1.0
#: Seconds a descendant gets to exit after SIGTERM before SIGKILL.
GRACE_S = 5.0


def start_reaper(replica_pid: int | None = None) -> subprocess.Popen:
    """Start the watcher of ``replica_pid`` (default: this process); returns its process.

    Its log lines go to this process's stderr (the replica's log file).
    """
    return subprocess.Popen(
        [sys.executable, "-m", "serve_app.server.engine_reaper",
         str(replica_pid or os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(replica_pid: int) -> list[psutil.Process]:
    """Wait until ``replica_pid`` is gone; return the descendants last seen alive with it."""
    me = os.getpid()
    try:
        replica = psutil.Process(replica_pid)
    except psutil.NoSuchProcess:
        return []
    seen: list[psutil.Process] = []
    while _alive(replica):
        try:
            seen = [p for p in replica.children(recursive=True) if p.pid != me]
        except psutil.NoSuchProcess:
            break
        time.sleep(POLL_S)
    return [p for p in seen if _alive(p)]


def stop(processes: list[psutil.Process]) -> None:
    """SIGTERM ``processes``, then SIGKILL those still running after :data:`GRACE_S`."""
    for p in processes:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(processes, timeout=GRACE_S)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def main(argv: list[str]) -> None:
    replica_pid = int(argv[0])
    orphans = watch(replica_pid)
    if orphans:
        names = ", ".join(f"{p.name()} ({p.pid})" for p in orphans if _alive(p))
        print(f"engine reaper: replica process {replica_pid} is gone; stopping what it left "
              f"running: {names}", file=sys.stderr, flush=True)
        stop(orphans)


if __name__ == "__main__":
    main(sys.argv[1:])
