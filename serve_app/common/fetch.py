"""Fetch a model or an adapter from its source into the node's cache, once per node.

Sources (:mod:`serve_app.common.sources`) and where each lands:

- ``local``: used where it is; nothing is fetched.
- ``hub``: ``huggingface_hub.snapshot_download`` of the pinned commit into the hub's own cache
  (``HF_HOME`` / ``HF_HUB_CACHE``), which honours ``HF_TOKEN``, ``HF_ENDPOINT`` and
  ``HF_HUB_OFFLINE`` (read when the fetch runs, so a replica's ``runtime_env`` sets them):
  :mod:`serve_app.common.hub_fetch`.
- ``bucket``: every object under ``s3://bucket/prefix`` or ``gs://bucket/prefix``, through
  obstore, into ``<cache>/buckets/<scheme>/<bucket>/<prefix>``
  (:func:`~serve_app.common.paths.cache_root`), each object fetched only while its ETag is
  still the listing's and the folder put in place only when every object is whole
  (:mod:`serve_app.common.bucket_fetch` says how, and which credentials it reads).

Nothing is written outside the cache: every object key and hub file name is checked
(:func:`~serve_app.common.sources.segment_problem`) and every path the fetch writes must
resolve under the cache root, before anything is downloaded. A download is capped
(:func:`~serve_app.common.fetch_guards.fetch_limits`: ``MESH_FETCH_MAX_BYTES``,
``MESH_FETCH_MAX_OBJECTS``), checked against the listing before the first byte.

One replica per node downloads a source at a time: the others wait on a file lock
(``<cache>/locks``) and then reuse what it fetched. Progress is logged every
:data:`~serve_app.common.node_cache.PROGRESS_EVERY_S` (bytes done of the total, MB/s). A
failure raises :class:`FetchError` with the source and the reason, and leaves nothing partial
in the cache; what a killed process left (``.<name>.partial-*``, ``.<name>.old-*``) is removed
by the next fetch of that source, and once per process, when older than
:data:`~serve_app.common.node_cache.STALE_AFTER_S` and no fetch holds its lock
(:func:`~serve_app.common.node_cache.sweep_leftovers`). Messages and log lines carry no
credential (:mod:`serve_app.common.redaction`).

This module holds the entry points; the parts are :mod:`serve_app.common.hub_fetch` (the
hub), :mod:`serve_app.common.bucket_fetch` (buckets), :mod:`serve_app.common.node_cache`
(node locks, progress lines, leftovers) and :mod:`serve_app.common.fetch_guards`
(:class:`FetchError`, the caps, path confinement).
"""

from __future__ import annotations

import time
from pathlib import Path

from serve_app.common.bucket_fetch import bucket_cache_dir, fetch_bucket, fetch_bucket_file
from serve_app.common.fetch_guards import FetchError, short_error
from serve_app.common.hub_fetch import fetch_hub, fetch_hub_file, hub_snapshot
from serve_app.common.logs import get_logger
from serve_app.common.node_cache import COMPLETE_RECORD, sweep_leftovers
from serve_app.common.paths import resolve_model_path, resolve_repo_path
from serve_app.common.redaction import redacting_logger
from serve_app.common.sources import HUB, LOCAL, FileSource, Source, parse_source

__all__ = ["FetchError", "cached_model", "fetch", "fetch_file", "fetch_model", "model_dir_here"]

logger = redacting_logger(get_logger(__name__))


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
        path = fetch_hub(source) if source.kind == HUB else fetch_bucket(source)
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 -- the client's error, reported whole
        raise FetchError(f"could not fetch {what} {source.describe()}: {short_error(e)}") from e
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
            return hub_snapshot(source, local_files_only=True)
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
    :func:`~serve_app.common.fetch_guards.fetch_limits`). When the bucket cannot be reached, the copy fetched before is used,
    with a warning. Blocking.

    Raises:
        FetchError: a remote file could not be fetched (the reason is in the message).
    """
    if source.kind == LOCAL:
        return Path(source.location)
    try:
        if source.kind == HUB:
            return fetch_hub_file(source)
        return fetch_bucket_file(source)
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 -- the client's error, reported whole
        raise FetchError(f"could not fetch {what} {source.describe()}: {short_error(e)}") from e
