"""Unit tests of stream coalescing (pure asyncio): the first chunk goes at once, then at most
one message per interval with everything that arrived; the text and the tail are unchanged."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.common.wire import Tail, Usage
from serve_app.server.coalesce import coalesce


async def tokens(n: int, every_s: float, fail: bool = False):
    for i in range(n):
        await asyncio.sleep(every_s)
        yield f"data: {i}\n\n"
    if fail:
        raise RuntimeError("engine died")
    yield Tail(Usage(3, n))


async def collect(items, interval_s):
    t0, out = time.monotonic(), []
    async for item in coalesce(items, interval_s):
        out.append((time.monotonic() - t0, item))
    return out


def test_first_chunk_at_once_then_batches_per_interval():
    out = asyncio.run(collect(tokens(20, 0.01), 0.05))
    text = [x for _, x in out if isinstance(x, str)]
    assert "".join(text) == "".join(f"data: {i}\n\n" for i in range(20))
    assert text[0] == "data: 0\n\n" and out[0][0] < 0.04  # not held back
    assert text[1] == "data: 1\n\n" and out[1][0] < 0.04  # nor the first token after it
    assert 3 <= len(text) <= 8  # ~0.2 s of tokens in 50 ms batches, not 20 messages
    assert out[-1][1] == Tail(Usage(3, 20))


def test_zero_interval_passes_every_item():
    out = asyncio.run(collect(tokens(5, 0.001), 0))
    assert [x for _, x in out][:5] == [f"data: {i}\n\n" for i in range(5)]


def test_an_error_comes_after_the_text_before_it():
    async def main():
        seen = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for item in coalesce(tokens(3, 0.001, fail=True), 0.05):
                seen.append(item)
        return seen
    assert "".join(asyncio.run(main())) == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


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
    before, after = asyncio.run(main())
    assert after == before  # the reader was cancelled with the stream
