"""Unit tests of the benchmarks' CPU accounting (serve_app/tools/host_cpu.py) on stand-in
engines: processes titled as vLLM titles its engine core, each with one child (its worker)
that either computes or sleeps."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from serve_app.tools.host_cpu import ENGINE_CORE_TITLE, EngineShare, cpu_seconds, engine_workers

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
    deadline = time.monotonic() + 20
    while sum(len(w) for c, w in engine_workers().items()
              if c in {p.pid for p in started}) < 2:
        assert time.monotonic() < deadline, "the stand-in engines' workers did not start"
        time.sleep(0.05)
    yield started
    for p in started:
        for proc in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
            proc.kill()
        p.wait()


def test_engine_share_counts_a_computing_engines_workers_and_leaves_an_idle_one_out(engines):
    assert {p.pid for p in engines} <= set(engine_workers())
    with EngineShare() as share:
        time.sleep(1.5)
    assert share.engines == 1  # the idle one (its worker asleep) is not counted
    # one process spinning on a 2-core host shared with the test runner: most of a core
    assert 0.4 < share.worker_cores <= 1.05


def test_cpu_seconds_counts_an_exited_process_as_nothing():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert cpu_seconds([p.pid]) == 0.0
    assert cpu_seconds([psutil.Process().pid]) > 0.0
