"""A bucket source fetched into the node's cache: every object under ``s3://bucket/prefix``
or ``gs://bucket/prefix``, through obstore (credentials from the environment: ``AWS_*`` for
S3, ``GOOGLE_*`` for GCS; an S3 endpoint of your own with ``AWS_ENDPOINT_URL``,
``AWS_ALLOW_HTTP=true`` for plain http), into ``<cache>/buckets/<scheme>/<bucket>/<prefix>``
(:func:`bucket_cache_dir`).

The prefix is listed first: every object key is checked
(:func:`~serve_app.common.sources.segment_problem`) and the caps
(:func:`~serve_app.common.fetch_guards.fetch_limits`) before the first byte. The objects are
written into a temporary folder beside the destination, each one fetched only while its ETag
is still the listing's (``If-Match``) and its size checked against the listing, and the
folder renamed into place only when every object is whole; a record of the listing
(:data:`~serve_app.common.node_cache.COMPLETE_RECORD`: names, sizes, ETags) marks it
complete. A later fetch lists the prefix again and reuses the folder while the listing is the
same (with a warning, also when the bucket cannot be listed at all). One object (a registry
file) is fetched again at every call (:func:`fetch_bucket_file`).
"""

from __future__ import annotations

import json
import shutil
import uuid
from datetime import timedelta
from pathlib import Path

from serve_app.common.fetch_guards import FetchError, fetch_limits, inside, short_error
from serve_app.common.logs import get_logger
from serve_app.common.node_cache import COMPLETE_RECORD, Progress, node_lock, remove_leftovers
from serve_app.common.paths import cache_root
from serve_app.common.redaction import redacting_logger
from serve_app.common.sources import FileSource, Source, segment_problem

logger = redacting_logger(get_logger(__name__))

#: What a bucket request may retry (obstore's default is 10 tries over 3 minutes; a start
#: that cannot reach its bucket should fail, and say so, well within a cold start's wait).
BUCKET_RETRY = {"max_retries": 2, "retry_timeout": timedelta(seconds=20),
                "backoff": {"init_backoff": timedelta(milliseconds=200),
                            "max_backoff": timedelta(seconds=2), "base": 2}}
_CHUNK = 8 << 20


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


def bucket_store(source: Source):
    """The obstore store of a bucket source's ``location`` (``s3://`` or ``gs://``), with
    credentials from the environment and the retries of :data:`BUCKET_RETRY`."""
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


def fetch_bucket(source: Source) -> Path:
    """The folder of a bucket source in the node's cache (:func:`bucket_cache_dir`),
    downloaded under the node lock of the source unless the copy there is complete and its
    listing is the bucket's now; when the bucket cannot be listed, that copy, with a
    warning. Removes what an earlier fetch of it left first. Blocking.

    Raises:
        FetchError: an object key that would climb, no objects, a listing over a cap, no
            listing and no copy, or a download that failed (nothing partial is kept).
        Exception: the store's own errors before the listing (as FetchError from
            :func:`~serve_app.common.fetch.fetch`).
    """
    dest = bucket_cache_dir(source)
    with node_lock(source.location):
        remove_leftovers(dest.parent, lambda n: f"{source.location.rsplit('/', 1)[0]}/{n}",
                         held=source.location)
        store = bucket_store(source)
        try:
            objects = _listing(store, source)
        except FetchError:
            raise
        except Exception as e:  # noqa: BLE001
            if (dest / COMPLETE_RECORD).is_file():
                logger.warning("%s cannot be listed (%s); using the copy fetched before in %s",
                               source.location, short_error(e), dest)
                return dest
            raise FetchError(f"could not list {source.location}: {short_error(e)}") from e
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
                             f"{short_error(e)}") from e
        raise


def _replaced(source: Source, obj: dict) -> str:
    return (f"{source.location}/{obj['path']} was replaced during the download (its ETag is no "
            f"longer the listing's {obj['e_tag']}); nothing was kept, the next fetch "
            "retries")


def fetch_bucket_file(source: FileSource) -> Path:
    """The local path of one bucket object, downloaded again at every call into
    ``<cache>/files/<scheme>/<bucket>/<key>`` and replaced whole (``If-Match`` on the ETag
    its ``HEAD`` gave, under the caps of :func:`~serve_app.common.fetch_guards.fetch_limits`);
    when the bucket cannot be read, the copy fetched before, with a warning. Blocking.

    Raises:
        FetchError: no copy and the object cannot be read, over a cap, replaced during the
            download, or come partial.
    """
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
                               source.describe(), short_error(e), dest)
                return dest
            raise FetchError(f"could not read {source.describe()}: {short_error(e)}") from e
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
