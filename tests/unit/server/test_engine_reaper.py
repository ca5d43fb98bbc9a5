"""The engine reaper on real processes (no Ray): a "replica" process starts a child (the
engine's stand-in, which ignores SIGTERM like a stuck engine) and its reaper; the replica is
then SIGKILLed, and the child must not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

import serve_app.server.engine_reaper as engine_reaper
from serve_app.common.paths import REPO_ROOT

REPLICA = textwrap.dedent("""
    import subprocess, sys, time
    from serve_app.server.engine_reaper import start_reaper
    start_reaper()
    engine = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print(engine.pid, flush=True)
    time.sleep(600)
""")


def test_a_killed_replica_takes_its_engine_with_it():
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE,
                               text=True, cwd=REPO_ROOT)
    engine = psutil.Process(int(replica.stdout.readline()))
    time.sleep(2 * engine_reaper.POLL_S + 0.5)  # the reaper has seen the engine
    os.kill(replica.pid, signal.SIGKILL)
    replica.wait()
    gone, alive = psutil.wait_procs([engine], timeout=engine_reaper.POLL_S
                                    + engine_reaper.GRACE_S + 5)
    assert gone and not alive, f"engine {engine.pid} outlived its replica"


def test_the_reaper_exits_with_a_replica_that_stops_normally():
    replica = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    reaper = psutil.Process(engine_reaper.start_reaper(replica.pid).pid)
    replica.wait()
    gone, _ = psutil.wait_procs([reaper], timeout=engine_reaper.POLL_S + 3)
    assert gone, "the reaper kept running after its replica"
