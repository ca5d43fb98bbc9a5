"""The router's FastAPI application and its error mapping, shared by the endpoint modules.

Every endpoint group registers its routes on :data:`app` (the OpenAI endpoints in
:mod:`serve_app.router`, ``/health`` and ``/admin/*`` in :mod:`serve_app.admin_endpoints`);
``MeshRouter`` is the Serve ingress over it. A :class:`~serve_app.common.errors.MeshError`
becomes its OpenAI error body and status; anything else is logged and answered 500
``internal error`` for that request only.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from serve_app.common.errors import MeshError, error_body
from serve_app.common.logs import get_logger

logger = get_logger(__name__)

app = FastAPI(title="model mesh", description="OpenAI-compatible router over vLLM variants")


@app.exception_handler(MeshError)
async def _mesh_error(_: Request, exc: MeshError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected router error")
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
