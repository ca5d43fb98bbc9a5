"""OpenAI-style errors: one exception type and one body format for every failure, and how a
refused config or field is reported.

Body format (OpenAI API reference, "Error codes"):
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
"""

from __future__ import annotations

from serve_app.common.logs import get_logger

from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

logger = get_logger(__name__)

# OpenAI's `type` for each status the mesh returns.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class MeshError(Exception):
    """A request failure with its HTTP status and OpenAI error fields.

    Args:
        status: HTTP status code (400, 401, 403, 404, 413, 415, 429, 503, ...).
        message: what was wrong and how to fix it, for the caller.
        param: the request field at fault, if any (e.g. ``"messages"``).
        code: a short machine-readable code (e.g. ``"model_not_found"``).
        headers: extra response headers (e.g. ``Retry-After`` on 429/503).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def of(cls, verdict, headers: dict[str, str] | None = None) -> MeshError:
        """The error for a :class:`serve_app.common.failures.Verdict`."""
        return cls(verdict.status, verdict.message, param=verdict.param, code=verdict.code,
                   headers=headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """Build the OpenAI error body for ``status`` (type chosen from the status)."""
    if code is None or isinstance(code, int):
        code = HTTPStatus(status).phrase.lower().replace(" ", "_")
    fallback = "server_error" if status >= 500 else "invalid_request_error"
    error_type = _TYPE_BY_STATUS.get(status, fallback)
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem: ``<path.to.field>: <message>``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        where = f"{prefix}.{path}" if prefix and path else (prefix or path or "<root>")
        lines.append(f"{where}: {e['msg']}")
    return "\n".join(lines)


def reject_user_config(last_good: object | None, message: str) -> None:
    """Refuse a new ``user_config`` in ``reconfigure()``.

    With no last good config (a replica's first one) this raises, so a bad first deploy fails
    visibly; otherwise it logs ``message`` and returns, and the caller keeps the last good
    config (raising there would make Serve replace a healthy replica).

    Raises:
        ValueError: ``last_good`` is None.
    """
    if last_good is None:
        raise ValueError(message)
    logger.error("%s\nkeeping the last good user_config", message)
