"""Unit tests of the benchmarks' CPU accounting (bench/host_cpu.py) on stand-in
engines: processes titled as vLLM titles its engine core, each with one child (its worker)
that either computes or sleeps."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from bench.host_cpu import (
                            ENGINE_CORE_TITLE,
                            IDLE_ENGINE_CORES,
                            EngineShare,
                            cpu_seconds,
                            engine_workers,
                            )
from tests.support.waits import wait_until

WORKER = {"computing": "while True: pass", "idle": "import time; time.sleep(120)"}


def _engine(kind: str) -> subprocess.Popen:
    """An 'engine core' (argv[0] is vLLM's title) whose one child runs WORKER[kind]."""
    # (under another argv[0] Python cannot find its own sys.executable: name it)
    child = f"import subprocess; subprocess.run([{sys.executable!r}, '-c', {WORKER[kind]!r}])"
    return subprocess.Popen(["bash", "-c", f'exec -a {ENGINE_CORE_TITLE} "$0" -c "$1"',
                             sys.executable, child], start_new_session=True)


@pytest.fixture
def engines():
    started = [_engine("computing"), _engine("idle")]
    try:
        def computing() -> bool:
            """Both workers started, and the computing one computing (past Python's start-up)."""
            workers = engine_workers(only=[p.pid for p in started])
            return (len(workers) >= 2 and sum(len(w) for w in workers.values()) >= 2
                    and workers[started[0].pid][0].cpu_times().user >= 0.2)

        wait_until(computing, 60, "the stand-in engines' workers started", every_s=0.05)
        yield started
    finally:
        for p in started:
            try:
                for proc in [*psutil.Process(p.pid).children(recursive=True),
                             psutil.Process(p.pid)]:
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
            p.wait()


def test_engine_share_counts_a_computing_engines_workers_and_leaves_an_idle_one_out(engines):
    """The computing engine's worker is counted, at most of a core; the idle one is not."""
    pids = [p.pid for p in engines]
    assert set(pids) <= set(engine_workers())  # found by their title on the whole host
    [worker] = engine_workers(only=pids[:1])[pids[0]]
    before, t0 = worker.cpu_times(), time.monotonic()
    with EngineShare(only=pids) as share:  # (only these: a real engine may be running)
        time.sleep(1.5)
    after, wall = worker.cpu_times(), time.monotonic() - t0
    assert share.engines == 1  # the idle one (its worker asleep) is not counted
    # the computing worker's CPU seconds over the block's wall seconds, and no more than a
    # core (one process)
    used = (after.user + after.system - before.user - before.system) / wall
    assert share.worker_cores == pytest.approx(used, rel=0.1, abs=0.02)
    assert IDLE_ENGINE_CORES <= share.worker_cores <= 1.05
    assert str(share) == f"1 x {share.worker_cores:.2f}"
    assert share.figures() == {"worker_cores": share.worker_cores, "busy_engines": 1,
                               "engines": str(share)}
    with EngineShare(only=[]) as none:
        pass
    assert (none.engines, none.worker_cores, str(none)) == (0, 0.0, "no vLLM engine")


def test_cpu_seconds_counts_an_exited_process_as_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert cpu_seconds([p.pid]) == 0.0
    assert cpu_seconds([psutil.Process().pid]) > 0.0
