"""A model's config files alone, read from its source for ``meshctl validate``: what vLLM's
checks of engine args against the model need (``config.json``; the tokenizer's and the
generation config when the model has them), never its weights.

- a local folder, or a hub or bucket model already in this node's cache
  (:func:`~serve_app.common.fetch.cached_model`): read in place;
- a hub id: ``huggingface_hub.hf_hub_download`` of each file at the pinned commit, into a
  folder of the caller's (not the hub cache: a snapshot folder holding only these files
  would pass for the whole model); ``HF_TOKEN``, ``HF_ENDPOINT`` as for a fetch;
- a bucket: ``<prefix>/config.json`` (and the others) through obstore, with the fetch's
  store and retry settings (:func:`~serve_app.common.bucket_fetch.bucket_store`).
"""

from __future__ import annotations

import os
from pathlib import Path

from serve_app.common.bucket_fetch import bucket_store
from serve_app.common.fetch import FetchError, cached_model
from serve_app.common.sources import BUCKET, HUB, parse_source

#: The file every model has; vLLM reads it for every model check.
CONFIG_FILE = "config.json"
#: Files read too when the model has them.
OPTIONAL_FILES = ("tokenizer_config.json", "generation_config.json")


class ModelNotThere(FetchError):
    """The source answered, and the model is not there: no such commit, or no
    ``config.json`` under the prefix. ``field``: the ``args`` field at fault (``revision``
    or ``model``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def config_folder_here(model: str, revision: str | None = None) -> Path | None:
    """The folder that holds a variant's model here, with its ``config.json``: a local
    folder, or a remote model in this node's cache; None otherwise."""
    folder = cached_model(model, revision)
    return folder if folder is not None and (folder / CONFIG_FILE).is_file() else None


def fetch_model_config(model: str, revision: str | None, dest: Path) -> Path:
    """Download a hub or bucket model's config files into ``dest`` (created), and return it.

    Raises:
        ModelNotThere: the source has no such model (a FetchError).
        FetchError: ``config.json`` could not be read (the message says from where and why).
    """
    source = parse_source(model, revision)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if source.kind == HUB:
            _from_hub(source, dest)
        elif source.kind == BUCKET:
            _from_bucket(source, dest)
        else:
            raise FetchError(f"{model!r} is a local folder: nothing to fetch")
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 -- the client's error, reported whole
        raise FetchError(f"could not read {CONFIG_FILE} of {source.describe()}: "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from e
    return dest


def _from_hub(source, dest: Path) -> None:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError, RevisionNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    _reachable(endpoint)
    for name in (CONFIG_FILE, *OPTIONAL_FILES):
        try:
            hf_hub_download(source.location, name, revision=source.revision, local_dir=dest,
                            endpoint=os.environ.get("HF_ENDPOINT") or None,
                            token=os.environ.get("HF_TOKEN") or None)
        except RevisionNotFoundError:
            raise ModelNotThere("revision", f"the hub has no commit {source.revision} of "
                                f"{source.location}: copy the full hash of an existing one "
                                f"(HfApi().model_info({source.location!r}).sha gives "
                                "today's)") from None
        except RemoteEntryNotFoundError:
            if name == CONFIG_FILE:
                raise ModelNotThere("model", f"{source.describe()} has no {CONFIG_FILE}: it "
                                    "is not a model repository vLLM can load") from None


def _reachable(url: str, timeout_s: float = 5.0) -> None:
    """Fail at once when ``url``'s host does not answer (no network, no such name), rather
    than after the hub client's five retries (~30 s).

    Raises:
        FetchError: the host cannot be reached (the reason in the message).
    """
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise FetchError(f"{parts.hostname}:{port} does not answer ({e.strerror or e})") from None


def _from_bucket(source, dest: Path) -> None:
    import obstore
    from obstore.exceptions import NotFoundError

    store = bucket_store(source)  # the fetch's store and retry settings
    for name in (CONFIG_FILE, *OPTIONAL_FILES):
        try:
            data = bytes(obstore.get(store, name).bytes())
        except (NotFoundError, FileNotFoundError):  # obstore raises either
            if name == CONFIG_FILE:
                raise ModelNotThere("model", f"{source.location}/{CONFIG_FILE} does not "
                                    "exist: upload the model's folder there (config.json, the "
                                    "weights, the tokenizer files), or fix the URI") from None
            continue
        (dest / name).write_bytes(data)
