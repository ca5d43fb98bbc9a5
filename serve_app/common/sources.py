"""Where a model's or an adapter's weights come from, read from a config value alone.

Three kinds, the same for a variant's ``args.model`` and an adapter's manifest ``uri``:

- ``local``: a directory on the node. A bare name (``smollm2-135m-instruct``) lives under
  ``$MESH_MODELS_DIR`` (default ``<repo>/models``); an absolute path, ``./x``, ``../x`` or
  ``file:///abs/path`` is that directory.
- ``hub``: a Hugging Face model id, ``org/name`` (as vLLM and Ray Serve LLM take it) or
  ``hf://org/name``, pinned by a ``revision``: a 40-hex commit hash, so every replica on every
  node serves the same weights (a branch or a tag moves).
- ``bucket``: ``s3://bucket/prefix`` or ``gs://bucket/prefix``: every object under the prefix,
  as a directory.

Nothing here touches the network or the disk: :func:`parse_source` and
:func:`source_problem` are what ``meshctl validate`` can say offline. Fetching is
:mod:`serve_app.common.fetch`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import unquote, urlsplit

LOCAL, HUB, BUCKET = "local", "hub", "bucket"
#: Bucket schemes, each with its object store (obstore).
BUCKET_SCHEMES = ("s3", "gs")
#: A pinned hub revision: a full commit hash.
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
#: A Hugging Face repo id (``huggingface_hub``'s rule: letters, digits, ``-_.``, at most 96
#: characters a part, no ``--`` or ``..``, not starting or ending with ``-`` or ``.``).
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
HUB_ID = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$")
#: S3 and GCS bucket names: 3-63 lowercase letters, digits, ``-`` and ``.`` (GCS also ``_``).
BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")


class SourceError(ValueError):
    """A model or adapter reference that names no usable source; the message says why and
    how to write it."""


@dataclass(frozen=True)
class Source:
    """A parsed reference.

    Attributes:
        kind: ``local``, ``hub`` or ``bucket``.
        ref: the value as written in the config.
        location: ``local``: the path as written (a bare name is resolved under
            ``$MESH_MODELS_DIR`` by :func:`~serve_app.common.paths.resolve_model_path`);
            ``hub``: the repo id ``org/name``; ``bucket``: ``scheme://bucket/prefix`` with no
            trailing ``/``.
        revision: the pinned commit of a hub source (None otherwise).
    """

    kind: Literal["local", "hub", "bucket"]
    ref: str
    location: str
    revision: str | None = None

    @property
    def remote(self) -> bool:
        """Fetched over the network into the node's cache (hub or bucket)."""
        return self.kind != LOCAL

    def describe(self) -> str:
        """For logs and errors: ``hf://org/name@<rev12>``, ``s3://b/p`` or the path."""
        if self.kind == HUB:
            return f"hf://{self.location}@{(self.revision or 'unpinned')[:12]}"
        return self.location


def parse_source(ref: str, revision: str | None = None) -> Source:
    """Parse a config's model or adapter reference.

    Args:
        ref: ``args.model`` or a manifest ``uri``.
        revision: the hub commit it is pinned to (``args.revision``, manifest ``revision``).

    Raises:
        SourceError: an unknown scheme, a malformed bucket URI or hub id, a hub id without a
            pinned revision, or a revision on a source that is not a hub id.
    """
    parts = urlsplit(ref)
    scheme = parts.scheme.lower()
    if len(scheme) == 1:  # a Windows drive letter is no scheme; treat as a path
        scheme = ""
    if scheme in BUCKET_SCHEMES:
        source = Source(BUCKET, ref, _bucket_location(ref, scheme, parts))
    elif scheme == "hf":
        source = Source(HUB, ref, _hub_id(parts.netloc + parts.path, ref), revision)
    elif scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise SourceError(f"{ref!r}: file:// URIs must be absolute (file:///path/to/dir)")
        source = Source(LOCAL, ref, unquote(parts.path))
    elif scheme:
        raise SourceError(f"{ref!r}: scheme '{scheme}://' is not supported; use a local "
                          "path, a Hugging Face id (org/name or hf://org/name) with a pinned "
                          "revision, or a bucket (s3://bucket/prefix, gs://bucket/prefix)")
    elif "/" in ref.strip("/") and not ref.startswith(("/", "./", "../", "~")):
        source = Source(HUB, ref, _hub_id(ref, ref), revision)
    else:
        source = Source(LOCAL, ref, ref)
    if source.kind == HUB:
        _check_revision(source)
    elif revision is not None:
        raise SourceError(f"{ref!r} is a {source.kind} source: 'revision' pins a Hugging Face "
                          "id only; remove it")
    return source


def source_problem(ref: str, revision: str | None = None) -> str | None:
    """Why ``ref`` (with ``revision``) names no usable source, or None: the offline check."""
    try:
        parse_source(ref, revision)
    except SourceError as e:
        return str(e)
    return None


def identity_of(ref: str) -> str:
    """What a model is, whatever its source: the last part of its path, id or bucket
    prefix (``org/Name`` -> ``Name``, ``s3://b/models/name/`` -> ``name``)."""
    parts = urlsplit(ref)
    path = (parts.netloc + parts.path) if len(parts.scheme) > 1 else ref
    return PurePosixPath(path.rstrip("/")).name or ref


def _bucket_location(ref: str, scheme: str, parts) -> str:
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if parts.query or parts.fragment:
        raise SourceError(f"{ref!r}: a bucket URI has no query or fragment "
                          f"({scheme}://bucket/prefix)")
    if not BUCKET_NAME.match(bucket) or ".." in bucket:
        raise SourceError(f"{ref!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, "
                          f"digits, '-', '.'); write {scheme}://<bucket>/<prefix>")
    if not prefix:
        raise SourceError(f"{ref!r}: name the folder inside the bucket "
                          f"({scheme}://{bucket}/<prefix>), not the whole bucket")
    return f"{scheme}://{bucket}/{prefix}"


def _hub_id(repo_id: str, ref: str) -> str:
    repo_id = repo_id.strip("/")
    if not HUB_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise SourceError(f"{ref!r} is not a Hugging Face model id (org/name: letters, digits, "
                          "'-', '_', '.'); a local folder is a bare name under "
                          "MESH_MODELS_DIR or a path (/abs/path, ./relative)")
    return repo_id


def _check_revision(source: Source) -> None:
    if source.revision is None:
        raise SourceError(f"{source.ref!r} is a Hugging Face id with no revision: pin the "
                          "commit every replica downloads with `revision: <40-hex commit "
                          "hash>` (the hub's 'main' moves; HfApi().model_info(id).sha gives "
                          "today's)")
    if not COMMIT_HASH.match(source.revision):
        raise SourceError(f"{source.ref!r}: revision {source.revision!r} is not pinned: a "
                          "branch or a tag can move between two replicas' starts; give the "
                          "full 40-hex commit hash")
