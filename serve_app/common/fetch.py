"""Fetch a model or an adapter from its source into the node's cache, once per node.

Sources (:mod:`serve_app.common.sources`) and where each lands:

- ``local``: used where it is; nothing is fetched.
- ``hub``: ``huggingface_hub.snapshot_download`` of the pinned commit into the hub's own cache
  (``HF_HOME`` / ``HF_HUB_CACHE``), which honours ``HF_TOKEN``, ``HF_ENDPOINT`` and
  ``HF_HUB_OFFLINE`` (read when the fetch runs, so a replica's ``runtime_env`` sets them).
- ``bucket``: every object under ``s3://bucket/prefix`` or ``gs://bucket/prefix``, through
  obstore (credentials from the environment: ``AWS_*`` for S3, ``GOOGLE_*`` for GCS; an S3
  endpoint of your own with ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP=true`` for plain http),
  into ``<cache>/buckets/<scheme>/<bucket>/<prefix>`` (:func:`~serve_app.common.paths.cache_root`).
  The objects are written into a temporary folder beside it, their sizes checked against the
  listing, and the folder renamed into place only when every object is whole; a record of the
  listing (names, sizes, ETags) marks it complete. A later fetch lists the prefix again and
  reuses the folder while the listing is the same (with a warning, also when the bucket
  cannot be listed at all).

One replica per node downloads a source at a time: the others wait on a file lock
(``<cache>/locks``) and then reuse what it fetched. Progress is logged every
:data:`PROGRESS_EVERY_S` (bytes done of the total, MB/s). A failure raises
:class:`FetchError` with the source and the reason, and leaves nothing partial in the cache.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterator

from serve_app.common.logs import get_logger
from serve_app.common.paths import cache_root, resolve_model_path, resolve_repo_path
from serve_app.common.sources import BUCKET, HUB, LOCAL, Source, parse_source

logger = get_logger(__name__)

#: Seconds between two progress lines of one download.
PROGRESS_EVERY_S = 5.0
#: What a bucket request may retry (obstore's default is 10 tries over 3 minutes; a start
#: that cannot reach its bucket should fail, and say so, well within a cold start's wait).
BUCKET_RETRY = {"max_retries": 2, "retry_timeout": timedelta(seconds=20),
                "backoff": {"init_backoff": timedelta(milliseconds=200),
                            "max_backoff": timedelta(seconds=2), "base": 2}}
#: The record of a complete bucket download, inside its folder.
COMPLETE_RECORD = ".mesh-source.json"
_CHUNK = 8 << 20


class FetchError(RuntimeError):
    """A source could not be fetched; the message names it and the reason."""


def fetch(source: Source, *, what: str = "model") -> Path:
    """The local directory of ``source``, downloaded first when it is remote and not in the
    node's cache. Blocking (run it in a thread from async code).

    Args:
        what: ``model`` or ``adapter``, for the log lines.

    Raises:
        FetchError: a remote source could not be fetched (the reason is in the message).
        FileNotFoundError: a local source does not exist.
    """
    if source.kind == LOCAL:
        return Path(resolve_model_path(source.location)) if what == "model" \
            else resolve_repo_path(source.location)
    t0 = time.monotonic()
    logger.info("fetching %s %s", what, source.describe())
    try:
        path = _fetch_hub(source) if source.kind == HUB else _fetch_bucket(source)
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 -- the client's error, reported whole
        raise FetchError(f"could not fetch {what} {source.describe()}: {_short(e)}") from e
    logger.info("%s %s is in %s (%.1f s)", what, source.describe(), path,
                time.monotonic() - t0)
    return path


def fetch_model(model: str, revision: str | None = None) -> Path:
    """:func:`fetch` of a variant's ``args.model`` (and ``args.revision``).

    Raises:
        FetchError, FileNotFoundError: as :func:`fetch`; SourceError: a malformed reference.
    """
    return fetch(parse_source(model, revision), what="model")


def cached_model(model: str, revision: str | None = None) -> Path | None:
    """The local directory of a variant's model when it is here already (a local folder, or
    a remote source fetched complete into this node's cache), else None. No network."""
    source = parse_source(model, revision)
    try:
        if source.kind == LOCAL:
            return Path(resolve_model_path(source.location))
        if source.kind == HUB:
            return _hub_snapshot(source, local_files_only=True)
        dest = bucket_cache_dir(source)
        return dest if (dest / COMPLETE_RECORD).is_file() else None
    except Exception:  # noqa: BLE001 -- not here, whatever the reason
        return None


def model_dir_here(model: str, revision: str | None = None) -> str:
    """The local directory vLLM reads a variant's model from: a local folder as
    :func:`~serve_app.common.paths.resolve_model_path` finds it, a remote source as this
    node's cache holds it (a replica fetches it first, :func:`fetch_model`). No network.

    Raises:
        FileNotFoundError: the folder does not exist, or the remote source is not fetched on
            this node (the message says which).
    """
    source = parse_source(model, revision)
    if source.kind == LOCAL:
        return resolve_model_path(source.location)
    path = cached_model(model, revision)
    if path is None:
        raise FileNotFoundError(f"model {source.describe()} is not fetched on this node yet: "
                                "a replica fetches it into the cache when it starts")
    return str(path)


# -- locks and progress -------------------------------------------------------------------

@contextmanager
def node_lock(name: str) -> Iterator[None]:
    """Hold the node-wide lock ``name`` (a file under ``<cache>/locks``), logging while
    another process holds it."""
    from filelock import FileLock, Timeout

    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(name.encode()).hexdigest()[:16]
    lock = FileLock(str(locks / f"{key}.lock"))
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


# -- hub ----------------------------------------------------------------------------------

def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_snapshot(source: Source, *, local_files_only: bool, tqdm_class=None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(
        source.location, revision=source.revision, cache_dir=_hub_cache(),
        endpoint=os.environ.get("HF_ENDPOINT") or None,
        token=os.environ.get("HF_TOKEN") or None,
        local_files_only=local_files_only or _env_flag("HF_HUB_OFFLINE"),
        tqdm_class=tqdm_class))


def _hub_cache() -> str | None:
    """The hub cache as the environment names it now (``HF_HUB_CACHE``, else
    ``$HF_HOME/hub``; None: the client's default): the client reads it once, at import."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


def _fetch_hub(source: Source) -> Path:
    from huggingface_hub.errors import LocalEntryNotFoundError

    with node_lock(source.describe()):
        try:
            return _hub_snapshot(source, local_files_only=False,
                                 tqdm_class=_logging_tqdm(source.describe()))
        except LocalEntryNotFoundError as e:
            if not _env_flag("HF_HUB_OFFLINE"):
                raise
            raise FetchError(f"could not fetch model {source.describe()}: HF_HUB_OFFLINE is "
                             f"set and the hub cache ({_hub_cache() or 'HF_HOME/hub'}) does "
                             "not hold this commit complete: fetch it there first, or unset "
                             "HF_HUB_OFFLINE") from e


def _logging_tqdm(what: str):
    """A tqdm class for ``snapshot_download`` that logs byte counts instead of drawing."""
    from tqdm.auto import tqdm

    class LoggingTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = io.StringIO()  # nothing drawn on the replica's stderr
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)
            self._log = Progress(f"{what} ({self.desc or 'files'})", None) \
                if self.unit == "B" else None

        def update(self, n=1):
            out = super().update(n)
            if self._log is not None and n and self.total:
                self._log.total = self.total or None
                self._log.add(int(n))
            return out

    return LoggingTqdm


# -- buckets ------------------------------------------------------------------------------

def bucket_cache_dir(source: Source) -> Path:
    """Where a bucket source lands: ``<cache>/buckets/<scheme>/<bucket>/<prefix>``."""
    scheme, rest = source.location.split("://", 1)
    return cache_root() / "buckets" / scheme / rest


def _store(source: Source):
    from obstore.store import from_url

    return from_url(source.location, retry_config=BUCKET_RETRY)


def _listing(store, source: Source) -> list[dict]:
    import obstore

    objects = []
    for batch in obstore.list(store):
        for meta in batch:
            path = meta["path"]
            if path.endswith("/") or not path:
                continue  # a "folder" marker object
            if path.startswith("/") or ".." in Path(path).parts:
                raise FetchError(f"{source.location}: object {path!r} would land outside "
                                 "its folder; refusing it")
            objects.append({"path": path, "size": int(meta["size"]),
                            "e_tag": meta.get("e_tag")})
    return sorted(objects, key=lambda o: o["path"])


def _fetch_bucket(source: Source) -> Path:
    dest = bucket_cache_dir(source)
    with node_lock(source.location):
        store = _store(source)
        try:
            objects = _listing(store, source)
        except FetchError:
            raise
        except Exception as e:  # noqa: BLE001
            if (dest / COMPLETE_RECORD).is_file():
                logger.warning("%s cannot be listed (%s); using the copy fetched before in %s",
                               source.location, _short(e), dest)
                return dest
            raise FetchError(f"could not list {source.location}: {_short(e)}") from e
        if not objects:
            raise FetchError(f"{source.location} holds no objects: upload the folder there "
                             "(config.json, the weights, the tokenizer files), or fix the URI")
        record = {"source": source.location, "objects": objects}
        try:
            if json.loads((dest / COMPLETE_RECORD).read_text()) == record:
                logger.info("%s: the copy in %s is up to date", source.location, dest)
                return dest
        except (OSError, ValueError):
            pass
        _download_objects(store, source, objects, dest, record)
        return dest


def _download_objects(store, source: Source, objects: list[dict], dest: Path,
                      record: dict) -> None:
    """Download ``objects`` into a temporary folder beside ``dest``, check each size, then
    put the folder in ``dest``'s place; on any failure remove it and raise FetchError."""
    import obstore

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    total = sum(o["size"] for o in objects)
    progress = Progress(source.location, total)
    current = ""
    try:
        for obj in objects:
            current = obj["path"]
            target = partial / obj["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                for chunk in obstore.get(store, obj["path"]).stream(min_chunk_size=_CHUNK):
                    f.write(chunk)
                    progress.add(len(chunk))
            if (got := target.stat().st_size) != obj["size"]:
                raise FetchError(f"{source.location}/{obj['path']} came partial: {got} of "
                                 f"{obj['size']} bytes")
        (partial / COMPLETE_RECORD).write_text(json.dumps(record, indent=1))
        progress.log()
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        if dest.exists():
            dest.rename(old)
        partial.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, FetchError):
            raise
        if isinstance(e, Exception):
            raise FetchError(f"download of {source.location} failed at {current!r} after "
                             f"{progress.done / 1e6:.1f} of {total / 1e6:.1f} MB: "
                             f"{_short(e)}") from e
        raise


def _short(e: BaseException, limit: int = 400) -> str:
    """One line of an exception (obstore's are multi-line Rust debug dumps)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}"
