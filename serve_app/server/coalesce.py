"""Coalesce a stream's SSE text into fewer messages, without delaying its first token.

Every item a replica yields crosses two Ray hops (replica -> router -> Serve proxy), each with
a fixed cost per message. So, as Ray Serve LLM does with ``stream_batching_interval_ms``, a
stream sends its first message at once (the first token; a chat's role-only chunk, which
vLLM yields just before it, travels with it: :meth:`~serve_app.server.serving.ReplicaServer._stream`)
and then at most one message per interval: everything that arrived in
the meantime, joined. A chunk waits at most one interval; no text is changed,
only how it is cut into messages. A batch of :class:`~serve_app.common.wire.StreamText`
carries the usage of its last piece that has one. Time is the event loop's
(``loop.time()``: monotonic), so a test can run it on a loop with a virtual clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TypeVar

from serve_app.common.wire import StreamText

T = TypeVar("T")

_END = object()
#: Messages sent before batching starts: the first token's (with a chat's role chunk).
UNBATCHED = 1


async def coalesce(items: AsyncIterator[str | T], interval_s: float,
                   attach: Callable[[str, T], T] | None = None) -> AsyncIterator[str | T]:
    """``items`` with consecutive strings joined, at most one batch per ``interval_s``; the
    stream's end is sent as soon as it comes, with the text before it.

    Non-string items (the stream's :class:`~serve_app.common.wire.Tail`) are passed on as
    they are, after the text before them; with ``attach``, a non-string item that ends a
    batch takes that batch's text (``attach(text, item)``): one message instead of two.
    ``interval_s`` <= 0 passes every item on at once.
    An exception of ``items`` is raised here, after the text before it. Closing this
    generator (the client left) closes ``items`` and returns once it is closed (so what
    ``items`` holds, an engine request, is let go before the caller goes on).
    """
    if interval_s <= 0:
        async with aclosing(items) as each:
            async for item in each:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async with aclosing(items) as each:
                async for item in each:
                    queue.put_nowait(item)
        except Exception as e:  # noqa: BLE001 -- re-raised on the consumer side
            queue.put_nowait(e)
        queue.put_nowait(_END)

    loop = asyncio.get_running_loop()
    reader = loop.create_task(pump())
    sent_at, sent = float("-inf"), 0
    try:
        while True:
            batch = [await queue.get()]
            wait = sent_at + interval_s - loop.time()
            if wait > 0 and sent >= UNBATCHED and isinstance(batch[0], str):
                await _collect_until_end(queue, batch, loop.time() + wait)
            while not queue.empty():
                batch.append(queue.get_nowait())
            text = [x for x in batch if isinstance(x, str)]
            rest = [x for x in batch if not isinstance(x, str) and x is not _END
                    and not isinstance(x, Exception)]
            if text:
                joined = "".join(text)
                usage = next((x.usage for x in reversed(text) if isinstance(x, StreamText)),
                             None)
                joined = joined if usage is None else StreamText(joined, usage)
                if attach is not None and len(rest) == 1 and batch.index(rest[0]) > max(
                        i for i, x in enumerate(batch) if isinstance(x, str)):
                    batch[batch.index(rest[0])] = attach(joined, rest[0])  # one message
                else:
                    yield joined
                sent_at, sent = loop.time(), sent + 1
            for x in batch:
                if x is _END:
                    return
                if isinstance(x, Exception):
                    raise x
                if not isinstance(x, str):
                    yield x
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)  # items closed when it returns


async def _collect_until_end(queue: asyncio.Queue, batch: list, deadline: float) -> None:
    """Add what ``queue`` gives to ``batch`` until the loop's clock reaches ``deadline``, or
    at once when the stream ends (its Tail, an error, the end): nothing more will come to
    batch, so the last text is not held back for the rest of the interval (a short stream's
    end, and with it the router's slot and the client's answer, waited up to a whole
    ``interval_s`` for nothing)."""
    try:
        # timeout_at, not wait_for: on Python 3.11, wait_for may swallow the cancellation of
        # a client that leaves just as a get completes, and makes a task per item
        async with asyncio.timeout_at(deadline):
            while True:
                item = await queue.get()
                batch.append(item)
                if not isinstance(item, str):
                    return
    except TimeoutError:
        return
