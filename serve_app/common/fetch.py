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
  The objects are written into a temporary folder beside it, each one fetched only while its
  ETag is still the listing's (``If-Match``) and its size checked against the listing, and the
  folder renamed into place only when every object is whole; a record of the listing (names,
  sizes, ETags) marks it complete. A later fetch lists the prefix again and reuses the folder
  while the listing is the same (with a warning, also when the bucket cannot be listed at all).

Nothing is written outside the cache: every object key and hub file name is checked
(:func:`~serve_app.common.sources.segment_problem`) and every path the fetch writes must
resolve under the cache root, before anything is downloaded. A download is capped
(:func:`fetch_limits`: ``MESH_FETCH_MAX_BYTES``, ``MESH_FETCH_MAX_OBJECTS``), checked
against the listing before the first byte.

One replica per node downloads a source at a time: the others wait on a file lock
(``<cache>/locks``) and then reuse what it fetched. Progress is logged every
:data:`PROGRESS_EVERY_S` (bytes done of the total, MB/s). A failure raises
:class:`FetchError` with the source and the reason, and leaves nothing partial in the cache;
what a killed process left (``.<name>.partial-*``, ``.<name>.old-*``) is removed by the next
fetch of that source, and once per process, when older than :data:`STALE_AFTER_S` and no
fetch holds its lock (:func:`sweep_leftovers`). Messages and log lines carry no credential
(:mod:`serve_app.common.redaction`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

from serve_app.common.logs import get_logger
from serve_app.common.paths import cache_root, resolve_model_path, resolve_repo_path
from serve_app.common.redaction import redact, redacting_logger
from serve_app.common.sources import (BUCKET, HUB, LOCAL, FileSource, Source, parse_source,
                                      segment_problem)

logger = redacting_logger(get_logger(__name__))

#: Seconds between two progress lines of one download.
PROGRESS_EVERY_S = 5.0
#: What a bucket request may retry (obstore's default is 10 tries over 3 minutes; a start
#: that cannot reach its bucket should fail, and say so, well within a cold start's wait).
BUCKET_RETRY = {"max_retries": 2, "retry_timeout": timedelta(seconds=20),
                "backoff": {"init_backoff": timedelta(milliseconds=200),
                            "max_backoff": timedelta(seconds=2), "base": 2}}
#: The record of a complete bucket download, inside its folder.
COMPLETE_RECORD = ".mesh-source.json"
#: Default caps of one download (a model's folder holds tens of files; the largest open
#: models are under 1 TB): override with ``MESH_FETCH_MAX_BYTES``, ``MESH_FETCH_MAX_OBJECTS``.
DEFAULT_MAX_BYTES = 2 << 40
DEFAULT_MAX_OBJECTS = 10_000
#: Seconds after which a leftover of a killed fetch, that no fetch holds the lock of, is
#: removed by :func:`sweep_leftovers`.
STALE_AFTER_S = 3600.0
#: The folders a fetch writes before a rename: ``.<name>.partial-<hex8>``, ``.<name>.old-<hex8>``.
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-[0-9a-f]{8}$")
_CHUNK = 8 << 20
_swept = threading.Event()  # this process swept the cache for leftovers


class FetchError(RuntimeError):
    """A source could not be fetched; the message names it and the reason, with any
    credential in it redacted."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


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
    sweep_leftovers()
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


def fetch_file(source: FileSource, *, what: str = "file") -> Path:
    """The local path of one file (:func:`~serve_app.common.sources.parse_file_source`): a
    local file as it is (not checked); a hub file at its commit from the hub cache
    (``hf_hub_download``); a bucket object downloaded again at every call (a file such as a
    registry is edited in place) into ``<cache>/files/<scheme>/<bucket>/<key>``, replaced
    whole (fetched with ``If-Match`` on the ETag its ``HEAD`` gave, under the caps of
    :func:`fetch_limits`). When the bucket cannot be reached, the copy fetched before is used,
    with a warning. Blocking.

    Raises:
        FetchError: a remote file could not be fetched (the reason is in the message).
    """
    if source.kind == LOCAL:
        return Path(source.location)
    try:
        if source.kind == HUB:
            return _fetch_hub_file(source)
        return _fetch_bucket_file(source)
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 -- the client's error, reported whole
        raise FetchError(f"could not fetch {what} {source.describe()}: {_short(e)}") from e


def _fetch_hub_file(source: FileSource) -> Path:
    from huggingface_hub import hf_hub_download

    hub_cache = _hub_cache()
    path = Path(hf_hub_download(
        source.location, source.path, revision=source.revision, cache_dir=hub_cache,
        endpoint=os.environ.get("HF_ENDPOINT") or None,
        token=os.environ.get("HF_TOKEN") or None, local_files_only=_env_flag("HF_HUB_OFFLINE")))
    snapshot = path.parents[len(Path(source.path).parts) - 1]
    return inside(snapshot.parent.parent, path, source.describe())


def _fetch_bucket_file(source: FileSource) -> Path:
    import obstore
    from obstore.exceptions import PreconditionError
    from obstore.store import from_url

    scheme, bucket = source.location.split("://", 1)
    root = cache_root() / "files"
    dest = inside(root, root / scheme / bucket / source.path, source.describe())
    with node_lock(source.describe()):
        store = from_url(source.location, retry_config=BUCKET_RETRY)
        try:
            meta = obstore.head(store, source.path)
        except Exception as e:  # noqa: BLE001
            if dest.is_file():
                logger.warning("%s cannot be read (%s); using the copy fetched before, %s",
                               source.describe(), _short(e), dest)
                return dest
            raise FetchError(f"could not read {source.describe()}: {_short(e)}") from e
        fetch_limits().check(source.describe(), 1, int(meta["size"]))
        e_tag = meta.get("e_tag")
        try:
            data = obstore.get(store, source.path,
                               options={"if_match": e_tag} if e_tag else {}).bytes()
        except PreconditionError:
            raise FetchError(f"{source.describe()} was replaced during the download (its ETag "
                             f"is no longer {e_tag}); nothing was kept, the next fetch "
                             "retries") from None
        if len(data) != int(meta["size"]):
            raise FetchError(f"{source.describe()} came partial: {len(data)} of "
                             f"{meta['size']} bytes")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            partial.write_bytes(bytes(data))
            partial.replace(dest)
        finally:
            partial.unlink(missing_ok=True)
        return dest


# -- locks and progress -------------------------------------------------------------------

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


def _hub_files(source: Source) -> list[tuple[str, int]]:
    """``(path, size)`` of every file of a hub source at its commit, from the hub's tree
    listing, after checking each path stays in the snapshot folder and the caps
    (:func:`fetch_limits`).

    Raises:
        FetchError: a file name with an empty, ``.`` or ``..`` part, or a listing over a cap.
        Exception: the hub's client's errors (not found, no network).
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None,
                token=os.environ.get("HF_TOKEN") or None)
    files = []
    for item in api.list_repo_tree(source.location, revision=source.revision, recursive=True):
        if not hasattr(item, "size") or getattr(item, "blob_id", None) is None:
            continue  # a folder
        if problem := segment_problem(item.path) or (
                "it starts with '/'" if item.path.startswith("/") else None):
            raise FetchError(f"{source.describe()}: the hub lists a file {item.path!r}: "
                             f"{problem}; it would land outside the snapshot folder, so "
                             "nothing of this repo is fetched")
        files.append((item.path, int(item.size or 0)))
    fetch_limits().check(source.describe(), len(files), sum(size for _, size in files))
    return files


def _fetch_hub(source: Source) -> Path:
    from huggingface_hub.errors import LocalEntryNotFoundError

    with node_lock(source.describe()):
        offline = _env_flag("HF_HUB_OFFLINE")
        listed = False
        if not offline:
            try:
                _hub_files(source)
                listed = True
            except FetchError:
                raise
            except Exception as e:  # noqa: BLE001 -- no listing: only the cache may serve
                try:
                    path = _hub_snapshot(source, local_files_only=True)
                except Exception:  # noqa: BLE001
                    raise FetchError(f"could not list {source.describe()} on the hub: "
                                     f"{_short(e)}") from e
                logger.warning("%s cannot be listed on the hub (%s); using the copy in the "
                               "hub cache, %s", source.describe(), _short(e), path)
                return _checked_snapshot(source, path)
        try:
            path = _hub_snapshot(source, local_files_only=not listed,
                                 tqdm_class=_logging_tqdm(source.describe()))
            return _checked_snapshot(source, path)
        except LocalEntryNotFoundError as e:
            if not _env_flag("HF_HUB_OFFLINE"):
                raise
            raise FetchError(f"could not fetch model {source.describe()}: HF_HUB_OFFLINE is "
                             f"set and the hub cache ({_hub_cache() or 'HF_HOME/hub'}) does "
                             "not hold this commit complete: fetch it there first, or unset "
                             "HF_HUB_OFFLINE") from e


def _checked_snapshot(source: Source, path: Path) -> Path:
    """``path``, a hub snapshot folder, after checking that every file in it resolves
    (through the cache's links) under the repo's folder of the hub cache.

    Raises:
        FetchError: one resolves elsewhere.
    """
    repo_folder = path.parent.parent  # <hub cache>/models--org--name/snapshots/<commit>
    for p in path.rglob("*"):
        inside(repo_folder, p, f"{source.describe()}: file {p.relative_to(path)}")
    return path


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
    """Where a bucket source lands: ``<cache>/buckets/<scheme>/<bucket>/<prefix>``.

    Raises:
        FetchError: the prefix has an empty, ``.`` or ``..`` part (a source made without
            :func:`~serve_app.common.sources.parse_source`), or the folder would resolve
            outside ``<cache>/buckets``.
    """
    scheme, rest = source.location.split("://", 1)
    if problem := segment_problem(rest):
        raise FetchError(f"{source.location}: {problem}; refused, it would land outside the "
                         "node's cache")
    root = cache_root() / "buckets"
    return inside(root, root / scheme / rest, source.location)


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
            if problem := segment_problem(path) or (
                    "it starts with '/'" if path.startswith("/") else None):
                raise FetchError(f"{source.location}: object {path!r}: {problem}; it would "
                                 "land outside its folder, so nothing of this prefix is "
                                 "fetched: rename the object or fix the URI")
            objects.append({"path": path, "size": int(meta["size"]),
                            "e_tag": meta.get("e_tag")})
    return sorted(objects, key=lambda o: o["path"])


def _fetch_bucket(source: Source) -> Path:
    dest = bucket_cache_dir(source)
    with node_lock(source.location):
        remove_leftovers(dest.parent, lambda n: f"{source.location.rsplit('/', 1)[0]}/{n}",
                         held=source.location)
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
        fetch_limits().check(source.location, len(objects), sum(o["size"] for o in objects))
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
    """Download ``objects`` into a temporary folder beside ``dest``, each only while its ETag
    is the listing's, check each size, then put the folder in ``dest``'s place; on any
    failure remove it and raise FetchError."""
    import obstore
    from obstore.exceptions import PreconditionError

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    total = sum(o["size"] for o in objects)
    progress = Progress(source.location, total)
    current = ""
    try:
        for obj in objects:
            current = obj["path"]
            target = inside(partial, partial / obj["path"],
                            f"{source.location}/{obj['path']}")
            target.parent.mkdir(parents=True, exist_ok=True)
            options = {"if_match": obj["e_tag"]} if obj["e_tag"] else {}
            try:
                result = obstore.get(store, obj["path"], options=options)
            except PreconditionError:
                raise FetchError(_replaced(source, obj)) from None
            if obj["e_tag"] and result.meta.get("e_tag") not in (None, obj["e_tag"]):
                raise FetchError(_replaced(source, obj))  # a store that ignores If-Match
            with open(target, "wb") as f:
                for chunk in result.stream(min_chunk_size=_CHUNK):
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


def _replaced(source: Source, obj: dict) -> str:
    return (f"{source.location}/{obj['path']} was replaced during the download (its ETag is no "
            f"longer the listing's {obj['e_tag']}); nothing was kept, the next fetch "
            "retries")


def _short(e: BaseException, limit: int = 400) -> str:
    """One line of an exception (obstore's are multi-line Rust debug dumps), redacted."""
    text = " ".join(str(e).split()) or type(e).__name__
    return redact(f"{type(e).__name__}: {text[:limit]}")
