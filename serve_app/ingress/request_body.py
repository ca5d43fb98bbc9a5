"""Read an OpenAI request's JSON body, refusing what cannot be one before parsing it."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from serve_app.common.errors import MeshError
from serve_app.common.failures import nested_too_deeply

#: Largest request body accepted, bytes (413 above it).
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def _check_body_size(size: int) -> None:
    if size > MAX_REQUEST_BYTES:
        raise MeshError(413, f"request body is {size} bytes; the limit is {MAX_REQUEST_BYTES} "
                        "bytes", code="request_too_large")


async def read_json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object.

    Raises:
        MeshError: 415 not ``application/json``; 413 over :data:`MAX_REQUEST_BYTES` (from
            ``Content-Length`` before reading, when the client sends one); 400 malformed JSON,
            nested too deeply, or not an object.
    """
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise MeshError(415, f"Content-Type must be application/json, got {content_type!r}",
                        code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit():  # refuse before reading a body that is too large
        _check_body_size(int(declared))
    raw = await request.body()
    _check_body_size(len(raw))
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MeshError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise MeshError.of(nested_too_deeply()) from None
    if not isinstance(body, dict):
        raise MeshError(400, "request body must be a JSON object", code="invalid_json")
    return body
