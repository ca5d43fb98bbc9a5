"""Start a task that many requests share, outside the request that happened to start it.

Inside a Serve replica, a task created while a request runs copies that request's
``contextvars``, and Ray (``_raylet``'s ``async_task_id``) takes the actor calls and
``DeploymentHandle`` calls such a task makes for *children of that request*. When its client
leaves, Serve cancels the request and Ray cancels its children recursively: a shared task's
calls die with a request they no longer belong to, whatever ``asyncio.shield`` its other
waiters hold. Found in CI: the tenant ledger's batched settlements, sent by a task the
abandoned stream had started, failed with ``TaskCancelledError`` (the stream and every
settlement batched with it stayed charged their reservations).

:func:`start_shared_task` runs the coroutine in an empty context: its calls belong to the
replica, not to any request. A shared wake, refresh, eviction or batch must use it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


def start_shared_task(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """``coro`` as a task of the running loop in a fresh, empty ``contextvars`` context (no
    request's Ray task id, Serve request context or log request id).

    Raises:
        RuntimeError: no event loop is running.
    """
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
