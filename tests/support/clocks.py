"""A fake clock for unit tests: seconds that move only when a test says so."""

from __future__ import annotations


class FakeClock:
    """Seconds (``now``) that move only when told: call it for the time now (in place of
    ``time.monotonic``), :meth:`advance` it, or set ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """A ``time.sleep`` on this clock: it advances, no real time passes."""
        self.advance(seconds)
