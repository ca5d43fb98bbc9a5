"""Group commit for calls to one Ray actor: one call in flight, the next batch collects meanwhile.

An actor runs its calls one at a time, and each call costs it a fixed overhead whatever it
does, so one actor answering a call per request caps the requests per second of every router
together (the cluster's :class:`~serve_app.tenancy.ledger.SharedTenantCounts`; the figures
are in docs/tenants-and-adapters.md, "The asks are batched"). :class:`CallBatcher` sends a call as soon as none is in flight, so at low load
a request waits for nothing extra; while one is in flight, the requests that arrive join the
next call, which goes out as soon as the first returns. Under load a call carries many
requests and the overhead is paid once per batch (the group commit of database logs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.common.shared_task import start_shared_task

#: Most items in one call (keeps one call's time on the actor short).
MAX_BATCH = 256


class CallBatcher:
    """Batches items for ``send`` (``list[item] -> awaitable list[result]``, same order).

    :meth:`submit` returns a future per item: its result, or the exception the call raised
    (or returned in that item's place: one item's failure, the others answered).
    A future nobody waits for any more (a caller that timed out) still gets its result, so
    its caller can undo what it counted (:mod:`serve_app.tenancy.limits` does).
    """

    def __init__(self, send: Callable[[list[Any]], Awaitable[list[Any]]],
                 max_batch: int = MAX_BATCH) -> None:
        self._send = send
        self._max_batch = max_batch
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._sending = False

    def submit(self, item: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if not self._sending:
            self._sending = True
            start_shared_task(self._drain())  # not a child of the submitting request
        return future

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:self._max_batch]
                self._pending = self._pending[self._max_batch:]
                try:
                    results = await self._send([item for item, _ in batch])
                except Exception as e:  # noqa: BLE001 - each caller gets it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for (_, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._sending = False
