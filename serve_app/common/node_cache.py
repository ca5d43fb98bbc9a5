"""The node's cache as fetches share it: one fetch of a source at a time per node
(:func:`node_lock`, a file lock under ``<cache>/locks``), progress lines of a download
(:class:`Progress`, every :data:`PROGRESS_EVERY_S`), and the removal of what a killed fetch
left (``.<name>.partial-*``, ``.<name>.old-*``): by the next fetch of that source
(:func:`remove_leftovers`), and once per process when older than :data:`STALE_AFTER_S` and
no fetch holds its lock (:func:`sweep_leftovers`). A complete bucket folder holds
:data:`COMPLETE_RECORD`. Log lines carry no credential (:mod:`serve_app.common.redaction`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from serve_app.common.logs import get_logger
from serve_app.common.paths import cache_root
from serve_app.common.redaction import redacting_logger

logger = redacting_logger(get_logger(__name__))

#: Seconds between two progress lines of one download (and of a wait for a node lock).
PROGRESS_EVERY_S = 5.0
#: The record of a complete bucket download, inside its folder.
COMPLETE_RECORD = ".mesh-source.json"
#: Seconds after which a leftover of a killed fetch, that no fetch holds the lock of, is
#: removed by :func:`sweep_leftovers`.
STALE_AFTER_S = 3600.0
#: The folders a fetch writes before a rename: ``.<name>.partial-<hex8>``, ``.<name>.old-<hex8>``.
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-[0-9a-f]{8}$")
_swept = threading.Event()  # this process swept the cache for leftovers


@contextmanager
def node_lock(name: str) -> Iterator[None]:
    """Hold the node-wide lock ``name`` (a file under ``<cache>/locks``), logging while
    another process holds it."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(_lock_path(name)))
    t0 = time.monotonic()
    while True:
        try:
            lock.acquire(timeout=PROGRESS_EVERY_S)
            break
        except Timeout:
            logger.info("waiting for another replica on this node to fetch %s (%.0f s)", name,
                        time.monotonic() - t0)
    try:
        yield
    finally:
        lock.release()


def _lock_path(name: str) -> Path:
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.lock"


def remove_leftovers(folder: Path, lock_name: Callable[[str], str], *,
                     older_than_s: float = STALE_AFTER_S, held: str | None = None) -> list[Path]:
    """Remove what killed fetches left in ``folder``: the entries named
    ``.<name>.partial-<hex8>`` or ``.<name>.old-<hex8>`` (:data:`LEFTOVER`) modified more than
    ``older_than_s`` ago, each only while no fetch holds the node lock ``lock_name(name)``
    (``held``: the one lock name the caller holds itself). Returns what was removed.
    """
    from filelock import FileLock, Timeout

    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        m = LEFTOVER.match(entry.name)
        if not m:
            continue
        name = lock_name(m["name"])
        try:
            if now - entry.lstat().st_mtime <= older_than_s:
                continue
            if name == held:
                _remove_tree(entry)
            else:
                lock = FileLock(str(_lock_path(name)))
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    continue  # a fetch of that source runs now
                try:
                    _remove_tree(entry)
                finally:
                    lock.release()
        except OSError as e:
            logger.warning("could not remove the leftover %s: %s", entry, e)
            continue
        logger.info("removed %s, left by a fetch that did not finish", entry)
        removed.append(entry)
    return removed


def sweep_leftovers(*, force: bool = False) -> list[Path]:
    """Once per process (``force``: again), remove the leftovers of killed fetches in the
    cache's bucket folders and files and adapter copies older than :data:`STALE_AFTER_S`
    whose source no fetch holds the lock of (:func:`remove_leftovers`). Returns what was
    removed."""
    if _swept.is_set() and not force:
        return []
    _swept.set()
    root = cache_root()
    removed: list[Path] = []
    for top in (root / "buckets", root / "files"):  # bucket folders, bucket files
        for folder, dirs, _ in os.walk(top):
            here = Path(folder)
            rel = here.relative_to(top).parts
            if len(rel) >= 2:  # <scheme>/<bucket>[/<prefix>...]: where a bucket source lands
                base = f"{rel[0]}://{'/'.join(rel[1:])}"
                removed += remove_leftovers(here, lambda n, base=base: f"{base}/{n}")
            dirs[:] = [d for d in dirs if not LEFTOVER.match(d) and
                       not (here / d / COMPLETE_RECORD).is_file()]
    removed += remove_leftovers(root / "adapters", lambda n: f"adapter {n}")
    return removed


def _remove_tree(path: Path) -> None:
    """Remove a folder, made read-only or not (an adapter's private copy)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for p in [path, *path.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            os.chmod(p, 0o700)
    shutil.rmtree(path)


class Progress:
    """Logs a download's bytes, at most every :data:`PROGRESS_EVERY_S` and at the end."""

    def __init__(self, what: str, total: int | None) -> None:
        self.what, self.total, self.done = what, total, 0
        self.t0 = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.log()

    def log(self) -> None:
        self.last = now = time.monotonic()
        rate = self.done / max(now - self.t0, 1e-6) / 1e6
        of = (f" of {self.total / 1e6:.1f} MB ({100 * self.done / self.total:.0f} %)"
              if self.total else "")
        logger.info("fetching %s: %.1f MB%s, %.1f MB/s", self.what, self.done / 1e6, of, rate)
