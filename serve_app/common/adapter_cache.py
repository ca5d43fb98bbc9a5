"""Private, read-only copies of adapter versions: what vLLM loads, verified before every load.

An adapter version's files are copied from its source (a local folder, the hub, a bucket:
:mod:`serve_app.common.fetch`) into ``<cache>/adapters/<sha256>/``, addressed by the
manifest's SHA-256 of its weights. The copy is made once per node (under a file lock, into a
temporary folder renamed into place only after :func:`~serve_app.common.adapters.check_adapter_files`
passed on it), then its files are made read-only and the ``adapters`` folder is the owner's
alone (mode 0700). A source changed after the copy was made cannot reach the engine; a source
changed before is refused when the copy is checked.

:func:`verified_copy` is what a replica calls right before every load into vLLM (the first
load, a load on first use, a reload after eviction): it makes the copy if it is missing and
hashes the copy's weights again. A copy that no longer matches is removed and refused; the
next load copies it again from the source.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

from serve_app.common.adapters import (WEIGHTS_FILE, AdapterError, AdapterSpec, adapter_source,
                                       check_adapter_files, sha256_file)
from serve_app.common.fetch import FetchError, fetch, node_lock
from serve_app.common.logs import get_logger
from serve_app.common.paths import cache_root

logger = get_logger(__name__)


def copies_dir() -> Path:
    """``<cache>/adapters``, created private (0700)."""
    root = cache_root() / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


def copy_path(spec: AdapterSpec) -> Path:
    """Where ``spec``'s private copy lives (whether it exists or not)."""
    return copies_dir() / spec.sha256


def private_copy(spec: AdapterSpec) -> Path:
    """The private copy of ``spec``, made from its source if this node has none.

    Raises:
        AdapterError: the source could not be fetched, or its files fail
            :func:`~serve_app.common.adapters.check_adapter_files` (SHA-256 mismatch,
            pickled weights, ...); nothing is left in the cache.
    """
    dest = copy_path(spec)
    if dest.is_dir():
        return dest
    source = adapter_source(spec)
    with node_lock(f"adapter {spec.sha256}"):
        if dest.is_dir():  # another replica made it meanwhile
            return dest
        try:
            fetched = fetch(source, what=f"adapter {spec.key}")
        except (FetchError, OSError) as e:
            raise AdapterError(f"adapter {spec.key}: {e}") from None
        partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(fetched, partial, ignore=shutil.ignore_patterns(".mesh-source.json",
                                                                            ".cache"))
            check_adapter_files(spec, partial)
            _read_only(partial)
            partial.rename(dest)
        except BaseException:
            _remove(partial)
            raise
        logger.info("adapter %s: private copy made from %s in %s", spec.key,
                    source.describe(), dest)
        return dest


def verified_copy(spec: AdapterSpec) -> Path:
    """:func:`private_copy` with its weights hashed again now: call right before handing the
    path to vLLM. Blocking (hashes the weights: ~0.1 s per 100 MB).

    Raises:
        AdapterError: the copy could not be made, or its weights no longer match the
            manifest's SHA-256 (the copy is removed: the next load copies it again).
    """
    path = private_copy(spec)
    actual = sha256_file(path / WEIGHTS_FILE)
    if actual != spec.sha256:
        _remove(path)
        raise AdapterError(
            f"adapter {spec.key}: its private copy {path} changed (SHA-256 {actual[:12]}..., "
            f"manifest {spec.sha256[:12]}...); refused and removed, the next load copies it "
            "again from its source")
    return path


def _read_only(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):
        os.chmod(p, 0o555 if p.is_dir() else 0o444)
    os.chmod(path, 0o555)


def _remove(path: Path) -> None:
    """Remove a copy made read-only (its folders need write permission back first)."""
    if not path.exists():
        return
    for p in [path, *path.rglob("*")]:
        if p.is_dir():
            os.chmod(p, stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)
