"""Private, read-only copies of adapter versions: what vLLM loads, verified before every load.

An adapter version's two files (``adapter_config.json``, ``adapter_model.safetensors``) are
copied from its source (a local folder, the hub, a bucket: :mod:`serve_app.common.fetch`)
into ``<cache>/adapters/<digest>/``, keyed by :attr:`~serve_app.common.adapters.AdapterSpec.digest`,
the hash of both files' registered SHA-256: two versions that differ in either file (the
same weights with another ``lora_alpha``) never share a copy. Nothing else of the source is
copied, so vLLM reads only registered bytes. The copy is made once per node (under a file
lock, into a temporary folder renamed into place only after
:func:`~serve_app.common.adapters.check_adapter_files` passed on it), then its files are made
read-only and the ``adapters`` folder is the owner's alone (mode 0700). A source changed after
the copy was made cannot reach the engine; a source changed before is refused when the copy
is checked.

:func:`verified_copy` is what a replica calls right before every load into vLLM (the first
load, a load on first use, a reload after eviction): it makes the copy if it is missing and
hashes both files again. A copy that no longer matches (a file changed, missing or added) is
removed and refused; the next load copies it again from the source.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

from serve_app.common.adapters import (AdapterError, AdapterSpec, adapter_source,
                                       check_adapter_files, check_no_pickles, sha256_file)
from serve_app.common.fetch import FetchError, fetch
from serve_app.common.logs import get_logger
from serve_app.common.node_cache import node_lock, remove_leftovers, sweep_leftovers
from serve_app.common.paths import cache_root
from serve_app.common.redaction import redacting_logger

logger = redacting_logger(get_logger(__name__))


def copies_dir() -> Path:
    """``<cache>/adapters``, created private (0700)."""
    root = cache_root() / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    return root


def copy_path(spec: AdapterSpec) -> Path:
    """Where ``spec``'s private copy lives (whether it exists or not): its
    :attr:`~serve_app.common.adapters.AdapterSpec.digest` under :func:`copies_dir`."""
    return copies_dir() / spec.digest


def _lock_name(digest: str) -> str:
    return f"adapter {digest}"


def private_copy(spec: AdapterSpec) -> Path:
    """The private copy of ``spec``, made from its source if this node has none.

    Raises:
        AdapterError: the source could not be fetched, its files fail
            :func:`~serve_app.common.adapters.check_adapter_files` (SHA-256 mismatch,
            pickled weights, ...), or the copy could not be written (a full disk); nothing
            is left in the cache.
    """
    dest = copy_path(spec)
    if dest.is_dir():
        return dest
    source = adapter_source(spec)
    sweep_leftovers()
    with node_lock(_lock_name(spec.digest)):
        if dest.is_dir():  # another replica made it meanwhile
            return dest
        remove_leftovers(dest.parent, _lock_name, held=_lock_name(spec.digest))
        try:
            fetched = fetch(source, what=f"adapter {spec.key}")
        except (FetchError, OSError) as e:
            raise AdapterError(f"adapter {spec.key}: {e}") from None
        partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            check_no_pickles(spec, fetched)
            partial.mkdir()
            for name in spec.files:  # only what is registered: what vLLM may read
                if (fetched / name).is_file():
                    shutil.copyfile(fetched / name, partial / name)
            check_adapter_files(spec, partial)
            _read_only(partial)
            partial.rename(dest)
        except OSError as e:  # a full disk, a permission: this adapter's failure alone
            _remove(partial)
            raise AdapterError(f"adapter {spec.key}: could not make its private copy in "
                               f"{dest.parent}: {e}") from None
        except BaseException:
            _remove(partial)
            raise
        logger.info("adapter %s: private copy made from %s in %s", spec.key,
                    source.describe(), dest)
        return dest


def verified_copy(spec: AdapterSpec) -> Path:
    """:func:`private_copy` with its files hashed again now: call right before handing the
    path to vLLM. Blocking (hashes the weights: ~0.1 s per 100 MB).

    Raises:
        AdapterError: the copy could not be made, or it no longer holds exactly the
            registered files with the manifest's SHA-256 (the copy is removed: the next load
            copies it again).
    """
    path = private_copy(spec)
    present = sorted(p.name for p in path.iterdir())
    problem = None
    if present != sorted(spec.files):
        problem = f"it holds {present}, not {sorted(spec.files)}"
    else:
        for name, want in spec.files.items():
            if (actual := sha256_file(path / name)) != want:
                problem = (f"{name} has SHA-256 {actual[:12]}..., manifest {want[:12]}...")
                break
    if problem:
        _remove(path)
        raise AdapterError(
            f"adapter {spec.key}: its private copy {path} changed ({problem}); refused and "
            "removed, the next load copies it again from its source")
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
