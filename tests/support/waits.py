"""Waiting on a condition, never on a fixed sleep: a predicate (in a thread, or an answer in an
event loop), a metric's total, metrics that have stopped moving."""

from __future__ import annotations

import asyncio
import time

from tests.support.metrics import metric_total


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.5):
    """Return once ``predicate()`` is true, asking every ``every_s``.

    Raises:
        AssertionError: not within ``timeout_s``; the message says ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


async def eventually(ask, within_s: float = 2.0, every_s: float = 0.02):
    """``await ask()`` every ``every_s`` until it answers something other than None, for at
    most ``within_s`` (real time): that answer, or the last None."""
    deadline = time.monotonic() + within_s
    while (answer := await ask()) is None and time.monotonic() < deadline:
        await asyncio.sleep(every_s)
    return answer


def wait_for_metric(mesh, name: str, at_least: float, timeout_s: float = 60, **labels) -> float:
    """:func:`~tests.support.metrics.metric_total` once it is at least ``at_least`` (read every
    2 s; the assertion fails past ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (value := metric_total(mesh, name, **labels)) < at_least:
        assert time.monotonic() < deadline, f"{name}{labels} stayed at {value}"
        time.sleep(2)
    return value


def settled(read, pause_s: float = 2.5, timeout_s: float = 60):
    """``read()`` once two reads ``pause_s`` apart agree (the test cluster exports metrics
    every second)."""
    deadline = time.monotonic() + timeout_s
    before = read()
    while True:
        time.sleep(pause_s)
        if (now := read()) == before:
            return now
        assert time.monotonic() < deadline, "the metrics did not settle"
        before = now
