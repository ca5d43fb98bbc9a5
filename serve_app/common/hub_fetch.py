"""A hub source fetched into the hub's own cache: ``huggingface_hub.snapshot_download`` of
the pinned commit (:func:`fetch_hub`) or ``hf_hub_download`` of one file at it
(:func:`fetch_hub_file`), into ``HF_HUB_CACHE`` / ``$HF_HOME/hub``, honouring ``HF_TOKEN``,
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` as they are when the fetch runs (a replica's
``runtime_env`` sets them). The repo's tree is listed first: every file name is checked
(:func:`~serve_app.common.sources.segment_problem`) and the caps
(:func:`~serve_app.common.fetch_guards.fetch_limits`) before anything is downloaded, and
every file of the snapshot must resolve under the repo's folder of the hub cache. When the
hub cannot be listed, a complete copy in the hub cache serves, with a warning.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from serve_app.common.fetch_guards import FetchError, fetch_limits, inside, short_error
from serve_app.common.logs import get_logger
from serve_app.common.node_cache import Progress, node_lock
from serve_app.common.redaction import redacting_logger
from serve_app.common.sources import FileSource, Source, segment_problem

logger = redacting_logger(get_logger(__name__))


def _env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1, true, yes or on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_snapshot(source: Source, *, local_files_only: bool, tqdm_class=None) -> Path:
    """The snapshot folder of a hub source at its commit in the hub cache, downloaded first
    unless ``local_files_only`` or ``HF_HUB_OFFLINE`` (``tqdm_class``: the client's progress
    bars). Not checked (:func:`fetch_hub` checks it).

    Raises:
        Exception: the hub client's errors (``LocalEntryNotFoundError``: not in the cache).
    """
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


def fetch_hub(source: Source) -> Path:
    """The snapshot folder of a hub source at its commit, fetched under the node lock of the
    source after its listing passed the name checks and the caps; without a listing (the hub
    unreachable), the copy in the hub cache, with a warning. Blocking.

    Raises:
        FetchError: a file name or a path that would land outside the repo's folder, a
            listing over a cap, no listing and no copy, or ``HF_HUB_OFFLINE`` with no copy.
        Exception: the hub client's other errors (:func:`~serve_app.common.fetch.fetch`
            reports them as FetchError).
    """
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
                    path = hub_snapshot(source, local_files_only=True)
                except Exception:  # noqa: BLE001
                    raise FetchError(f"could not list {source.describe()} on the hub: "
                                     f"{short_error(e)}") from e
                logger.warning("%s cannot be listed on the hub (%s); using the copy in the "
                               "hub cache, %s", source.describe(), short_error(e), path)
                return _checked_snapshot(source, path)
        try:
            path = hub_snapshot(source, local_files_only=not listed,
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


def fetch_hub_file(source: FileSource) -> Path:
    """The local path of one hub file at its commit, from the hub cache
    (``hf_hub_download``). Blocking.

    Raises:
        FetchError: the file would resolve outside the repo's folder of the hub cache.
        Exception: the hub client's errors (:func:`~serve_app.common.fetch.fetch_file`
            reports them as FetchError).
    """
    from huggingface_hub import hf_hub_download

    hub_cache = _hub_cache()
    path = Path(hf_hub_download(
        source.location, source.path, revision=source.revision, cache_dir=hub_cache,
        endpoint=os.environ.get("HF_ENDPOINT") or None,
        token=os.environ.get("HF_TOKEN") or None, local_files_only=_env_flag("HF_HUB_OFFLINE")))
    snapshot = path.parents[len(Path(source.path).parts) - 1]
    return inside(snapshot.parent.parent, path, source.describe())
