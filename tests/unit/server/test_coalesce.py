"""Unit tests of stream coalescing on an event loop with a virtual clock (time advances only
when every task waits, by exactly what they wait for), so each message's time is exact: the
first chunk goes at once, then at most one message per interval with everything that
arrived; the text and the tail are unchanged."""

from __future__ import annotations

import asyncio
import selectors

import pytest

from serve_app.common.wire import Tail, Usage
from serve_app.server.coalesce import coalesce


class _VirtualClockSelector(selectors.DefaultSelector):
    """A selector that never blocks: with nothing ready, it moves the clock to the loop's
    next timer instead of sleeping."""

    now = 0.0

    def select(self, timeout=None):
        events = super().select(0)
        if not events and timeout:
            self.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._clock = _VirtualClockSelector()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now


def run(coro):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def tokens(n: int, every_s: float, fail: bool = False):
    for i in range(n):
        await asyncio.sleep(every_s)
        yield f"data: {i}\n\n"
    if fail:
        raise RuntimeError("engine died")
    yield Tail(Usage(3, n))


async def collect(items, interval_s):
    loop = asyncio.get_running_loop()
    t0, out = loop.time(), []
    async for item in coalesce(items, interval_s):
        out.append((round(loop.time() - t0, 6), item))
    return out


def test_first_chunk_at_once_then_batches_per_interval():
    out = run(collect(tokens(20, 0.01), 0.047))
    text = [(t, x) for t, x in out if isinstance(x, str)]
    assert "".join(x for _, x in text) == "".join(f"data: {i}\n\n" for i in range(20))
    # tokens at 10, 20, ... 200 ms: the first as it comes; then a message 47 ms after
    # the last one, with every token that came meanwhile (a token waits at most 47 ms); the
    # end goes as it comes (200 ms), with the text before it, not at 208 ms
    assert text[:1] == [(0.01, "data: 0\n\n")]
    assert [t for t, _ in text[1:]] == [0.057, 0.104, 0.151, 0.198, 0.2]
    assert [len(x.split("\n\n")) - 1 for _, x in text[1:]] == [4, 5, 5, 4, 1]
    assert out[-1] == (0.2, Tail(Usage(3, 20)))


def test_a_streams_end_is_not_held_for_the_rest_of_the_interval():
    """A short stream on a fast engine ends 5 ms after its first tokens: with a 100 ms
    interval its last text and end used to wait out the interval (the router's slot and the
    client's answer with them); now they go as the end comes."""
    out = run(collect(tokens(5, 0.001), 0.1))
    # the first token at once; the other four and the end as the end comes (5 ms), not at
    # 101 ms
    assert [t for t, _ in out] == [0.001, 0.005, 0.005]
    assert out[-1] == (0.005, Tail(Usage(3, 5)))


def test_zero_interval_passes_every_item_when_it_comes():
    out = run(collect(tokens(5, 0.001), 0))
    assert out[:5] == [(0.001 * (i + 1), f"data: {i}\n\n") for i in range(5)]


def test_an_error_comes_after_the_text_before_it():
    async def main():
        seen = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for item in coalesce(tokens(3, 0.001, fail=True), 0.05):
                seen.append(item)
        return seen
    assert "".join(run(main())) == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_closing_early_stops_reading():
    read = []

    async def source():
        for i in range(1000):
            read.append(i)
            await asyncio.sleep(0.001)
            yield f"{i}"

    async def main():
        gen = coalesce(source(), 0.01)
        await gen.__anext__()
        await gen.aclose()
        n = len(read)
        await asyncio.sleep(0.05)
        return n, len(read)
    before, after = run(main())
    assert after == before  # the reader was cancelled with the stream


def test_the_last_text_goes_with_the_stream_end_in_one_message():
    """With ``attach``, the batch that ends the stream is one message: the tail carries the
    text (before, the text and the tail were two Ray messages); unbundled gives it back as
    the router reads it."""
    from dataclasses import replace

    from serve_app.common.wire import Tail, unbundled

    async def items():
        for piece in ("a", "b", "c"):
            yield piece
        yield Tail()

    async def main():
        sent = [x async for x in coalesce(items(), 0.05,
                                          attach=lambda text, tail: replace(tail, text=text))]

        async def again():
            for x in sent:
                yield x
        return sent, [x async for x in unbundled(again())]

    sent, read = asyncio.run(main())
    assert sent == [Tail(text="abc")]  # ready together: one message, not two
    assert "".join(x for x in read if isinstance(x, str)) == "abc"
    assert read[-1] == Tail()
