"""CPU time of processes on this host (psutil), for benchmarks: what the mesh's processes
cost per request (``bench.py --router-throughput``), and what share of the host's cores each
vLLM engine got while a load ran (``bench.py --adapters`` and ``--sessions``).

Why the engines' share: on a CPU host the engines and the mesh's own processes (router,
proxy, Serve controller, Ray) share the cores. The simulated engine's profile is of one
engine with the host to itself, so ``bench.py --sim --trust`` replays a run on a profile
slowed by the cores that run's engine workers got against what vLLM's own server's got
(:attr:`EngineShare.worker_cores`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil

#: vLLM's process titles (``setproctitle``): the engine core (scheduler) and its workers.
ENGINE_CORE_TITLE, WORKER_TITLE = "VLLM::EngineCore", "VLLM::Worker"
#: An engine that used less than this share of a core during a load was idle (another
#: variant's engine, say); it is not counted among the engines that shared the host.
IDLE_ENGINE_CORES = 0.1


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the live processes ``pids`` have used; a process that has
    exited counts 0."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _title(p: psutil.Process) -> str:
    try:
        return (p.cmdline() or [""])[0]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def engine_workers() -> dict[int, list[int]]:
    """Each vLLM engine on this host: its ``EngineCore`` pid -> the pids of its workers (its
    child processes, where the model runs)."""
    engines = {}
    for p in psutil.process_iter():
        if _title(p).startswith(ENGINE_CORE_TITLE):
            try:
                engines[p.pid] = [c.pid for c in p.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
    return engines


class EngineShare:
    """The cores each busy vLLM engine's workers got while the ``with`` block ran.

    ``with EngineShare() as share: <load>`` then ``share.worker_cores`` (cores, mean over the
    busy engines: CPU seconds of an engine's workers / wall seconds) and ``share.engines``
    (how many were busy, their workers above :data:`IDLE_ENGINE_CORES`). The workers run the
    model; the ``EngineCore`` beside them schedules, and busy-polls for their output between
    steps, so its CPU says little about the engine's speed. Engines are found when the block
    starts; ``worker_cores`` is 0.0 when none was busy."""

    def __enter__(self) -> EngineShare:
        self._engines = engine_workers()
        self._before = {core: cpu_seconds(pids) for core, pids in self._engines.items()}
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(1e-9, time.monotonic() - self._t0)
        cores = [(cpu_seconds(pids) - self._before[core]) / wall
                 for core, pids in self._engines.items()]
        busy = [c for c in cores if c >= IDLE_ENGINE_CORES]
        self.engines = len(busy)
        self.worker_cores = sum(busy) / len(busy) if busy else 0.0
