"""Relay a variant's SSE stream to the client, and close its account exactly once.

:class:`RelayResponse` is a Starlette ``StreamingResponse`` over the text a replica streams
after its head (see :mod:`serve_app.common.wire`): each item is passed on as it comes, as
one body chunk, with no parsing: a piece's token counts so far come with it
(:class:`~serve_app.common.wire.StreamText`) and go to the account, so a stream that ends
without its usage chunk (its client left, or it failed) is charged the tokens generated,
not one per SSE event. When the stream ends, for any reason, the request's
:class:`~serve_app.dispatch.account.RequestAccount` is finished once. That includes a
client that disconnects before the body starts: Starlette then never enters the body's
generator, so a ``finally`` inside it would not run; the response's own ``__call__`` catches
that case.

Error kinds a stream ends with: None (completed), ``"client_disconnected"``,
``"stream_failed"`` (a variant failure: the replica died, or vLLM's engine did and vLLM sent
an in-band error event), ``"internal_error"`` or ``"request_error"`` (an in-band error event
of those kinds, see :mod:`serve_app.common.failures`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from serve_app.common.logs import get_logger
from serve_app.common.errors import MeshError, error_body
from serve_app.common.failures import Failure, replica_gone
from serve_app.common.wire import Tail, sse_error

logger = get_logger(__name__)

#: Metric error kind of a stream that ended with an in-band error event of each failure kind.
STREAM_ERROR_KIND = {Failure.VARIANT: "stream_failed", Failure.INTERNAL: "internal_error",
                     Failure.REQUEST: "request_error"}


class RelayResponse(StreamingResponse):
    """SSE response relaying ``stream`` (the replica's text after its head).

    Args:
        stream: async iterator of SSE text and a final :class:`Tail`.
        variant: the variant that serves it (for the error event and logs).
        account: the request's account (``t0``, ``finish(status, ttft_s=, usage=,
            error_kind=)``), finished when the stream ends.
        headers: response headers.
        on_replica_lost: called with ``variant`` when the stream ends because its replica is
            gone (see :meth:`VariantAvailability.replica_lost`).
        first: text sent before ``stream``'s (a held stream's first SSE comment line).
    """

    def __init__(self, stream, variant: str, account, headers: dict[str, str],
                 on_replica_lost=None, first: str = "") -> None:
        self._account = account
        self._on_replica_lost = on_replica_lost
        self._stream = stream
        super().__init__(self._relay(stream, variant, first), media_type="text/event-stream",
                         headers=headers)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette may stop between two items (a disconnect cancels its send): close
            # both generators now, so the variant's slot and its replica's request end
            # here, not when garbage collection finds them.
            await self.body_iterator.aclose()
            if hasattr(self._stream, "aclose"):
                await self._stream.aclose()
            # the body may never have started (client gone first)
            self._account.finish(200, error_kind="client_disconnected")

    async def _relay(self, stream, variant: str, first: str = "") -> AsyncIterator[str]:
        """Pass the text through; a failure mid-stream ends it with an SSE error event and
        ``[DONE]`` (the status is already sent), as vLLM ends its own failed streams."""
        ttft = None
        tail = Tail()
        error_kind = None
        status = 200  # what the account records: a held stream's refusal records its own
        try:
            if first:
                yield first
            async for item in stream:
                if isinstance(item, Tail):  # the end, with the last text when it came along
                    tail, error_kind = item, STREAM_ERROR_KIND.get(item.failure)
                    if not item.text:
                        continue
                    item = item.text
                if item.startswith(":"):  # an SSE comment (a held cold start): no data
                    yield item
                    continue
                if ttft is None:
                    ttft = time.monotonic() - self._account.t0
                # The events, and the tokens so far (a StreamText's; vLLM merges several
                # tokens into one event when its consumer lags).
                self._account.relayed(item.count("data: {"), getattr(item, "usage", None))
                self._account.relayed_text(item)  # a mirrored request keeps its answer
                yield item
        except asyncio.CancelledError:
            error_kind = "client_disconnected"
            raise
        except MeshError as e:  # the mesh refused a held stream after its headers were sent
            error_kind, status = e.code or f"http_{e.status}", e.status
            if e.status != 500:
                self._account.refused(e.status, error_kind)
            yield sse_error(e.body())
        except Exception as e:
            error_kind = "stream_failed"
            logger.error("variant %s failed mid-stream: %s: %s", variant, type(e).__name__, e)
            if self._on_replica_lost is not None and replica_gone(e):
                self._on_replica_lost(variant)
            message = f"variant {variant} failed mid-stream; retry the request"
            yield sse_error(error_body(503, message))
        finally:
            self._account.finish(status, ttft_s=ttft, usage=tail.usage, error_kind=error_kind)
