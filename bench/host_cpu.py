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

#: vLLM's title (``setproctitle``) of an engine's core process (its scheduler), whose child
#: processes are the engine's workers (``VLLM::Worker``).
ENGINE_CORE_TITLE = "VLLM::EngineCore"
#: An engine whose workers used less than this share of a core during a load was idle
#: (another variant's engine, say); it is not counted among the engines that shared the host.
IDLE_ENGINE_CORES = 0.1


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the live processes ``pids`` have used; a process that has
    exited counts 0."""
    return sum(cpu_by_pid(pids).values())


def cpu_by_pid(pids: Iterable[int]) -> dict[int, float]:
    """pid -> user + system CPU seconds, for those of the processes ``pids`` that live."""
    out = {}
    for pid in pids:
        try:
            cpu = _cpu(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
        if cpu is not None:
            out[pid] = cpu
    return out


def _title(p: psutil.Process) -> str:
    try:
        return (p.cmdline() or [""])[0]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def engine_workers(only: Iterable[int] | None = None) -> dict[int, list[psutil.Process]]:
    """Each vLLM engine on this host (or those whose ``EngineCore`` pid is in ``only``): its
    ``EngineCore`` pid -> its workers (its child processes, where the model runs)."""
    wanted = None if only is None else set(only)
    engines = {}
    for p in psutil.process_iter():
        if (wanted is None or p.pid in wanted) and _title(p).startswith(ENGINE_CORE_TITLE):
            try:
                engines[p.pid] = p.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
    return engines


def _cpu(p: psutil.Process) -> float | None:
    """``p``'s user + system CPU seconds; None once it has exited (psutil checks the pid is
    still the same process, so a reused pid is not counted)."""
    try:
        t = p.cpu_times()
    except psutil.NoSuchProcess:
        return None
    return t.user + t.system


class EngineShare:
    """The cores each busy vLLM engine's workers got while the ``with`` block ran.

    ``with EngineShare() as share: <load>`` then ``share.worker_cores`` (cores, mean over the
    busy engines: CPU seconds of an engine's workers / wall seconds) and ``share.engines``
    (how many were busy, their workers above :data:`IDLE_ENGINE_CORES`). The workers run the
    model; the ``EngineCore`` beside them schedules, and busy-polls for their output between
    steps, so its CPU says little about the engine's speed. The workers busy-poll too between
    steps (for a second after their last one), so their share is what they got of the host,
    not only what their steps needed. Engines are those on the host when the block starts
    (``only``: the ``EngineCore`` pids to look at); a worker that exits meanwhile is left
    out; ``worker_cores`` is 0.0 when none was busy (no vLLM engine: the simulated one, or
    vLLM without its engine process)."""

    def __init__(self, only: Iterable[int] | None = None) -> None:
        self._only = only

    def __enter__(self) -> EngineShare:
        self._engines = {core: [(w, _cpu(w)) for w in workers]
                         for core, workers in engine_workers(self._only).items()}
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(1e-9, time.monotonic() - self._t0)
        cores = []
        for workers in self._engines.values():
            used = [(_cpu(w), before) for w, before in workers]
            cores.append(sum(after - before for after, before in used
                             if after is not None and before is not None) / wall)
        busy = [c for c in cores if c >= IDLE_ENGINE_CORES]
        self.engines = len(busy)
        self.worker_cores = sum(busy) / len(busy) if busy else 0.0

    def figures(self) -> dict:
        """What a benchmark keeps of it: ``worker_cores``, ``busy_engines`` and ``engines``
        (the two as its tables show them, :meth:`__str__`)."""
        return {"worker_cores": self.worker_cores, "busy_engines": self.engines,
                "engines": str(self)}

    def __str__(self) -> str:
        """``2 x 0.78`` (busy engines x the cores each one's workers got), or ``no vLLM
        engine`` (the simulated engine)."""
        return f"{self.engines} x {self.worker_cores:.2f}" if self.engines else "no vLLM engine"
