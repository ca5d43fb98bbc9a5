"""Read an OpenAI request's JSON body, refusing what cannot be one before parsing it.

The body is read as it streams in, counting bytes, and refused (413) the moment it passes
:data:`MAX_REQUEST_BYTES`: a chunked body (no ``Content-Length``) of any size never holds
more than the limit in the router's memory.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from serve_app.common.errors import MeshError
from serve_app.common.failures import nested_too_deeply

#: Largest request body accepted, bytes (413 above it).
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def _too_large(size: str) -> MeshError:
    return MeshError(413, f"request body is {size} bytes; the limit is {MAX_REQUEST_BYTES} "
                     "bytes", code="request_too_large")


async def _read_limited(request: Request) -> bytes:
    """The body, read chunk by chunk; MeshError 413 as soon as it passes the limit."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            raise _too_large(f"more than {MAX_REQUEST_BYTES}")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object.

    Raises:
        MeshError: 415 not ``application/json``; 413 over :data:`MAX_REQUEST_BYTES` (from
            ``Content-Length`` before reading, when the client sends one; else once the bytes
            read pass it); 400 malformed JSON (an integer literal past Python's digit limit
            included), nested too deeply, or not an object.
    """
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise MeshError(415, f"Content-Type must be application/json, got {content_type!r}",
                        code="unsupported_media_type")
    declared = request.headers.get("content-length", "").strip()
    if declared.isascii() and declared.isdigit() and (  # refuse before reading a body
            len(declared) > 12 or int(declared) > MAX_REQUEST_BYTES):  # that is too large
        raise _too_large(declared if len(declared) <= 12 else f"more than {MAX_REQUEST_BYTES}")
    raw = await _read_limited(request)
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int over 4300 digits
        raise MeshError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise MeshError.of(nested_too_deeply()) from None
    if not isinstance(body, dict):
        raise MeshError(400, "request body must be a JSON object", code="invalid_json")
    return body
