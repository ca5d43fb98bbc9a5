"""An ASGI app that records whether each slow request's client disconnect reached it (run
with uvicorn by tests/unit/common/test_haproxy_launch.py).

``POST /fast`` answers at once. ``POST /slow`` watches ASGI ``receive()`` for
``http.disconnect`` for up to :data:`WATCH_S` and appends ``REQUEST_ID seen`` or
``REQUEST_ID missed`` to ``$DISCONNECT_LOG``, then answers.
"""

from __future__ import annotations

import asyncio
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

#: Seconds a slow request waits for its client's disconnect.
WATCH_S = 5.0


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def slow(request: Request) -> JSONResponse:
    await request.body()
    try:
        await asyncio.wait_for(_disconnected(request), WATCH_S)
        outcome = "seen"
    except asyncio.TimeoutError:
        outcome = "missed"
    with open(os.environ["DISCONNECT_LOG"], "a") as log:
        log.write(f"{request.headers['x-request-id']} {outcome}\n")
    return JSONResponse({"outcome": outcome})


async def fast(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse({})


app = Starlette(routes=[Route("/slow", slow, methods=["POST"]),
                        Route("/fast", fast, methods=["POST"])])
