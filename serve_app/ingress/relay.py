"""Relay a variant's SSE stream to the client, and account for it exactly once.

:class:`RelayResponse` is a Starlette ``StreamingResponse`` over the lines a replica streams
(see :mod:`serve_app.wire`). When the stream ends, for any reason, it calls
``finish(ttft_s, tail, error_kind)`` once, so the router can release the tenant's slot and
record metrics. That includes a client that disconnects before the body starts: Starlette
then never enters the body's generator, so a ``finally`` inside it would not run; the
response's own ``__call__`` catches that case.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from serve_app.common.errors import error_body
from serve_app.common.failures import Failure
from serve_app.common.wire import Tail

logger = logging.getLogger("ray.serve")

#: ``finish(ttft_s, tail, error_kind)``: ``error_kind`` is None (completed),
#: ``"client_disconnected"``, ``"stream_failed"`` (a variant failure: the replica died, or
#: vLLM's engine did and it sent an in-band error event), ``"internal_error"`` or
#: ``"request_error"`` (an in-band error event of those kinds, see :mod:`serve_app.failures`);
#: ``ttft_s`` in s, None if no chunk was sent.
Finish = Callable[[float | None, Tail, str | None], None]

#: Metric error kind of a stream that ended with an in-band error event of each failure kind.
STREAM_ERROR_KIND = {Failure.VARIANT: "stream_failed", Failure.INTERNAL: "internal_error",
                     Failure.REQUEST: "request_error"}


class RelayResponse(StreamingResponse):
    """SSE response relaying ``stream`` (the replica's lines after its head).

    Args:
        stream: async iterator of SSE text and a final :class:`Tail`.
        variant: the variant that serves it (for the error event and logs).
        t0: ``time.monotonic()`` when the request arrived (for TTFT).
        finish: called exactly once when the stream ends (see :data:`Finish`).
        headers: response headers.
    """

    def __init__(self, stream, variant: str, t0: float, finish: Finish,
                 headers: dict[str, str]) -> None:
        self._finish, self._finished = finish, False
        super().__init__(self._lines(stream, variant, t0), media_type="text/event-stream",
                         headers=headers)

    def _end(self, ttft_s: float | None, tail: Tail, error_kind: str | None) -> None:
        if not self._finished:
            self._finished = True
            self._finish(ttft_s, tail, error_kind)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # the body may never have started (client gone first)
            self._end(None, Tail(), "client_disconnected")

    async def _lines(self, stream, variant: str, t0: float) -> AsyncIterator[str]:
        """Pass SSE lines through; a failure mid-stream ends it with an SSE error event (the
        status is already sent)."""
        ttft = None
        tail = Tail()
        error_kind = None
        try:
            async for item in stream:
                if isinstance(item, Tail):
                    tail = item
                    error_kind = STREAM_ERROR_KIND.get(tail.failure)
                    continue
                if ttft is None:
                    ttft = time.monotonic() - t0
                yield item
        except asyncio.CancelledError:
            error_kind = "client_disconnected"
            raise
        except Exception as e:
            error_kind = "stream_failed"
            logger.error("variant %s failed mid-stream: %s: %s", variant, type(e).__name__, e)
            message = f"variant {variant} failed mid-stream; retry the request"
            yield f"data: {json.dumps(error_body(503, message))}\n\ndata: [DONE]\n\n"
        finally:
            self._end(ttft, tail, error_kind)
