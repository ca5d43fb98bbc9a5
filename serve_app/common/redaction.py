"""Credentials out of messages and log lines.

A model or adapter reference may carry a secret written into it by mistake: the userinfo
of a URI (``s3://AKIA...:secret@bucket/x``, ``https://user:token@host/...``) or the query of
a presigned URL (``X-Amz-Signature=...``, ``X-Goog-Signature=...``, Azure's ``sig=...``).
:func:`redact` replaces each with ``***``; the errors of the sources, the fetch and the
adapter registry (``SourceError``, ``FetchError``, ``AdapterError``) redact their messages
when they are made, and :class:`RedactingFilter` does the same to the log lines of the
modules that name sources, so a secret reaches no replica log, no ``/admin/adapters``
answer and no ``meshctl validate`` output.
"""

from __future__ import annotations

import logging
import re

#: What stands in for a secret.
MASK = "***"
#: ``scheme://userinfo@``: everything between ``://`` and the ``@`` before the host.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"?#]+@")
#: ``user:secret@host`` written without a scheme (a URI's netloc quoted in a message).
_BARE_USERINFO = re.compile(r"(?<![\w.+:/-])[\w.+-]+:[^\s@/'\"]+@(?=[\w.-])")
#: ``name=value`` of a query parameter whose name says it is a secret (presigned S3 / GCS
#: URLs, Azure SAS tokens, API keys and tokens in a query string).
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;](?:X-Amz-[A-Za-z-]+|X-Goog-[A-Za-z-]+|[A-Za-z_-]*(?:sig|signature|token|"
    r"credential|secret|password|passwd|key|auth)[A-Za-z_-]*)=)[^&#\s'\"]*",
    re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every URI's userinfo (and a bare ``user:secret@host``) and every secret
    query value replaced by :data:`MASK` (``s3://AKIA:secret@b/x`` -> ``s3://***@b/x``;
    ``...?X-Amz-Signature=abc&x=1`` -> ``...?X-Amz-Signature=***&x=1``). Idempotent."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _BARE_USERINFO.sub(f"{MASK}@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['name']}{MASK}", text)


class RedactingFilter(logging.Filter):
    """A logging filter that formats each record and passes it on with :func:`redact`
    applied (the arguments are folded into the message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def redacting_logger(logger: logging.Logger) -> logging.Logger:
    """``logger`` with a :class:`RedactingFilter` (added once)."""
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
    return logger
