"""What a fetch refuses, and how it says so: :class:`FetchError`, the caps of one download
(:func:`fetch_limits`: ``MESH_FETCH_MAX_BYTES``, ``MESH_FETCH_MAX_OBJECTS``, checked against
a listing before the first byte) and path confinement (:func:`inside`: every path a fetch
writes must resolve under its root). Messages carry no credential
(:mod:`serve_app.common.redaction`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from serve_app.common.redaction import redact

#: Default caps of one download (a model's folder holds tens of files; the largest open
#: models are under 1 TB): override with ``MESH_FETCH_MAX_BYTES``, ``MESH_FETCH_MAX_OBJECTS``.
DEFAULT_MAX_BYTES = 2 << 40
DEFAULT_MAX_OBJECTS = 10_000


class FetchError(RuntimeError):
    """A source could not be fetched; the message names it and the reason, with any
    credential in it redacted."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


def short_error(e: BaseException, limit: int = 400) -> str:
    """One line of an exception (obstore's are multi-line Rust debug dumps), at most
    ``limit`` characters of its text after its type's name, redacted."""
    text = " ".join(str(e).split()) or type(e).__name__
    return redact(f"{type(e).__name__}: {text[:limit]}")


@dataclass(frozen=True)
class FetchLimits:
    """The most one download may hold: ``max_bytes`` (bytes) and ``max_objects`` (files)."""

    max_bytes: int
    max_objects: int

    def check(self, what: str, n_objects: int, n_bytes: int) -> None:
        """Raise FetchError when a listing of ``n_objects`` files of ``n_bytes`` bytes
        in all is over a cap (before anything is downloaded)."""
        if n_objects > self.max_objects:
            raise FetchError(f"{what} holds {n_objects} objects, over the cap of "
                             f"{self.max_objects} (MESH_FETCH_MAX_OBJECTS): point the URI at "
                             "the model's or adapter's own folder, or raise the cap")
        if n_bytes > self.max_bytes:
            raise FetchError(f"{what} holds {n_bytes} bytes ({n_bytes / 1e9:.1f} GB), over "
                             f"the cap of {self.max_bytes} bytes ({self.max_bytes / 1e9:.1f} "
                             "GB, MESH_FETCH_MAX_BYTES): point the URI at the model's or "
                             "adapter's own folder, or raise the cap")


def fetch_limits() -> FetchLimits:
    """The caps of one download, read now: ``$MESH_FETCH_MAX_BYTES`` (default
    :data:`DEFAULT_MAX_BYTES`, 2 TiB) and ``$MESH_FETCH_MAX_OBJECTS`` (default
    :data:`DEFAULT_MAX_OBJECTS`).

    Raises:
        FetchError: a variable that is not a whole number >= 1.
    """
    def read(name: str, default: int) -> int:
        text = os.environ.get(name, "").strip()
        if not text:
            return default
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise FetchError(f"{name}={text!r} is not a whole number >= 1; unset it for the "
                             f"default ({default})")
        return value
    return FetchLimits(read("MESH_FETCH_MAX_BYTES", DEFAULT_MAX_BYTES),
                       read("MESH_FETCH_MAX_OBJECTS", DEFAULT_MAX_OBJECTS))


def inside(root: Path, path: Path, what: str) -> Path:
    """``path``, after checking that it resolves (symbolic links followed) under ``root``.

    Raises:
        FetchError: it would land outside ``root``.
    """
    real_root, real = root.resolve(), path.resolve()
    if real != real_root and real_root not in real.parents:
        raise FetchError(f"{what} would be written at {real}, outside {real_root}; refused")
    return path
