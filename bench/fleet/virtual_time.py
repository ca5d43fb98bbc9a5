"""An asyncio event loop on a virtual clock: when no callback is ready, time jumps to the next
timer instead of waiting for it.

A fleet of simulated engines (:mod:`bench.fleet.fleet`) runs the mesh's own asyncio code
(admission's futures and deadlines, the engines' step loops) on this loop, so an hour of
traffic on 32 replicas takes as long as its Python work, and every duration is exact. The
technique is the one of the ``looptime`` pytest plugin and of Trio's ``MockClock(autojump)``:
``loop.time()`` returns the virtual clock, and the selector, asked to wait ``t`` seconds for
I/O, advances the clock by ``t`` and returns at once. Only code that uses the loop's clock
(``asyncio.sleep``, ``wait_for``, ``call_later``, or a ``clock=loop.time`` argument) sees
virtual time; there must be no real I/O to wait for.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; a wait of ``t`` s moves the loop's clock by ``t``."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        if timeout is None:  # nothing ready and no timer: nothing can ever happen
            raise RuntimeError("virtual-time loop: every task waits on something that no "
                               "timer or task will bring (a deadlock in the simulation)")
        self._loop.now += max(0.0, timeout)
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose :meth:`time` is virtual seconds from 0 (see the module
    docstring)."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop` and close it.

    Raises:
        RuntimeError: the simulation deadlocked (no task could ever run again).
    """
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
