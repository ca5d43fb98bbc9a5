"""Unit tests of the group-commit batcher (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.tenancy.call_batcher import CallBatcher


def test_one_call_in_flight_and_the_next_batch_collects_meanwhile():
    async def main():
        sent: list[list[int]] = []

        async def send(items):
            sent.append(items)
            await asyncio.sleep(0.01)
            return [i * 10 for i in items]
        b = CallBatcher(send, max_batch=50)
        first = b.submit(0)
        await asyncio.sleep(0)  # the first call is out, alone
        rest = [b.submit(i) for i in range(1, 121)]
        assert await first == 0
        assert await asyncio.gather(*rest) == [i * 10 for i in range(1, 121)]
        assert [len(batch) for batch in sent] == [1, 50, 50, 20]
    asyncio.run(main())


def test_a_failed_call_fails_its_batch_only():
    async def main():
        calls = []

        async def send(items):
            calls.append(items)
            if len(calls) == 1:
                raise ConnectionError("actor died")
            return items
        b = CallBatcher(send)
        doomed = b.submit("a")
        with pytest.raises(ConnectionError):
            await doomed
        assert await b.submit("b") == "b"
    asyncio.run(main())
