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

No part of a bucket prefix or a hub id may be empty, ``.`` or ``..`` (also
percent-encoded: ``%2e%2e``, a ``%2F`` inside a part), so no source can name a folder outside
the node's cache; and a URI carries no credentials (userinfo, a presigned query): they belong
in the node's environment, and every message redacts them
(:mod:`serve_app.common.redaction`).

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

from serve_app.common.redaction import redact

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
    how to write it, with any credential in it redacted."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


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


def parse_source(ref: str, revision: str | None = None, *,
                 revision_field: str = "revision") -> Source:
    """Parse a config's model or adapter reference.

    Args:
        ref: ``args.model`` or a manifest ``uri``.
        revision: the hub commit it is pinned to (``args.revision``, manifest ``revision``).
        revision_field: the name of ``revision``'s field, for the messages.

    Raises:
        SourceError: an unknown scheme, a malformed bucket URI or hub id, a hub id without a
            pinned revision, or a revision on a source that is not a hub id.
    """
    parts = urlsplit(ref)
    scheme = parts.scheme.lower()
    if len(scheme) == 1:  # a Windows drive letter is no scheme; treat as a path
        scheme = ""
    if scheme and "@" in parts.netloc:
        raise SourceError(f"{ref!r}: a URI carries no credentials (they would show in the "
                          "config, the dashboard and the logs): remove the 'user:secret@' part "
                          "and give them in the nodes' environment (AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN)")
    if scheme in BUCKET_SCHEMES:
        source = Source(BUCKET, ref, _bucket_location(ref, scheme, parts))
    elif scheme == "hf":
        if parts.query or parts.fragment:
            raise SourceError(f"{ref!r}: a hub id has no query or fragment (hf://org/name, "
                              "with the commit in 'revision')")
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
        _check_revision(source, revision_field)
    elif revision is not None:
        raise SourceError(f"{ref!r} is a {source.kind} source: '{revision_field}' pins a "
                          "Hugging Face id only; remove it")
    return source


@dataclass(frozen=True)
class FileSource:
    """One file, as a variant's ``adapters_manifest`` names it (:func:`parse_file_source`).

    Attributes:
        kind: ``local``, ``hub`` or ``bucket``.
        ref: the value as written in the config.
        location: ``local``: the path as written (``file://`` taken off); ``hub``: the repo
            id ``org/name``; ``bucket``: ``scheme://bucket``.
        path: the file inside the repo or bucket (the object key); "" for a local file.
        revision: the commit of a hub file (None otherwise).
    """

    kind: Literal["local", "hub", "bucket"]
    ref: str
    location: str
    path: str = ""
    revision: str | None = None

    def describe(self) -> str:
        """For logs and errors: ``hf://org/name@<rev12>/path``, ``s3://b/key`` or the path."""
        if self.kind == HUB:
            return f"hf://{self.location}@{(self.revision or '')[:12]}/{self.path}"
        if self.kind == BUCKET:
            return f"{self.location}/{self.path}"
        return self.location


def parse_file_source(ref: str) -> FileSource:
    """Parse a reference to one file: a local path (absolute, relative, ``file:///abs``), a
    bucket object (``s3://bucket/key``, ``gs://bucket/key``) or a file of a hub repo at a
    commit (``hf://org/name@<40-hex commit>/path/in/repo``, ``huggingface_hub``'s
    ``HfFileSystem`` form).

    Raises:
        SourceError: another scheme, credentials in it, a malformed bucket or hub part, a hub
            file without a pinned commit, or a path part that is empty, ``.`` or ``..``.
    """
    parts = urlsplit(ref)
    scheme = parts.scheme.lower()
    if len(scheme) == 1:
        scheme = ""
    if scheme in BUCKET_SCHEMES or scheme == "hf":
        if "@" in parts.netloc:
            parse_source(ref)  # its message: no credentials in a URI
        if parts.query or parts.fragment:
            raise SourceError(f"{ref!r}: a file URI has no query or fragment")
    if scheme in BUCKET_SCHEMES:
        key = parts.path.removeprefix("/")
        location = _bucket_location(f"{scheme}://{parts.netloc}/{key}", scheme, parts)
        return FileSource(BUCKET, ref, f"{scheme}://{parts.netloc}", location.split("/", 3)[3])
    if scheme == "hf":
        repo, at, rest = f"{parts.netloc}{parts.path}".partition("@")
        revision, _, path = rest.partition("/")
        if not at or not COMMIT_HASH.match(revision):
            raise SourceError(f"{ref!r}: a file on the hub is written "
                              "hf://org/name@<40-hex commit>/path/in/repo, pinned to the commit "
                              "every replica reads (a branch or a tag moves)")
        repo_id = _hub_id(repo, ref)
        if not path or (problem := segment_problem(path)):
            raise SourceError(f"{ref!r}: name the file in the repo after the commit "
                              f"(hf://{repo_id}@<commit>/path/in/repo)"
                              + (f"; {problem}" if path else ""))
        return FileSource(HUB, ref, repo_id, path, revision)
    if scheme == "file":
        return FileSource(LOCAL, ref, parse_source(ref).location)
    if scheme:
        raise SourceError(f"{ref!r}: scheme '{scheme}://' is not supported; use a local path, "
                          "a bucket object (s3://bucket/key, gs://bucket/key) or a file of a "
                          "hub repo (hf://org/name@<commit>/path)")
    return FileSource(LOCAL, ref, ref)


def source_problem(ref: str, revision: str | None = None) -> str | None:
    """Why ``ref`` (with ``revision``) names no usable source, or None: the offline check."""
    try:
        parse_source(ref, revision)
    except SourceError as e:
        return str(e)
    return None


def identity_of(ref: str) -> str:
    """A model's short name, whatever its source: the last part of its path, id or bucket
    prefix (``org/Name`` -> ``Name``, ``s3://b/models/name/`` -> ``name``), for labels and
    the names of models derived from it. Adapters are matched by :func:`model_key`."""
    parts = urlsplit(ref)
    path = (parts.netloc + parts.path) if len(parts.scheme) > 1 else ref
    return PurePosixPath(path.rstrip("/")).name or ref


def model_key(ref: str, revision: str | None = None, *,
              revision_field: str = "revision") -> str:
    """What a model is, for matching an adapter's ``base_model`` with a variant's model: a
    hub id at its commit (``hf://org/name@<commit>``), a bucket folder
    (``s3://bucket/prefix``), or a local folder's name (``smollm2-135m-instruct`` for
    ``smollm2-135m-instruct``, ``models/smollm2-135m-instruct`` and
    ``/srv/models/smollm2-135m-instruct``: a node names a local model by any path to it).
    Sources of different kinds are different models.

    Raises:
        SourceError: ``ref`` (with ``revision``) is no usable source (:func:`parse_source`).
    """
    source = parse_source(ref, revision, revision_field=revision_field)
    if source.kind == HUB:
        return f"hf://{source.location}@{source.revision}"
    if source.kind == BUCKET:
        return source.location
    return identity_of(source.location)


def segment_problem(path: str) -> str | None:
    """Why ``path`` (``/``-separated, as a bucket prefix, an object key or a hub file name
    is written) could name something outside its folder, or None: a part that is empty,
    ``.`` or ``..``, or becomes one, or holds a ``/`` or ``\\``, once percent-decoded
    (``%2e%2e``, ``a%2Fb``); or a control character."""
    for part in path.split("/"):
        decoded = unquote(part)
        if decoded in ("", ".", ".."):
            shown = f"{part!r} (percent-encoded {decoded!r})" if part != decoded else repr(part)
            return f"it has a path part {shown}" if part else "it has an empty path part ('//')"
        if "/" in decoded or "\\" in decoded:
            return f"its part {part!r} holds a path separator once percent-decoded"
        if any(ord(c) < 32 or ord(c) == 127 for c in decoded):
            return f"its part {part!r} holds a control character"
    return None


def _bucket_location(ref: str, scheme: str, parts) -> str:
    bucket = parts.netloc
    prefix = parts.path.removeprefix("/").removesuffix("/")
    if parts.query or parts.fragment:
        raise SourceError(f"{ref!r}: a bucket URI has no query or fragment "
                          f"({scheme}://bucket/prefix)")
    if not BUCKET_NAME.match(bucket) or ".." in bucket:
        raise SourceError(f"{ref!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, "
                          f"digits, '-', '.'); write {scheme}://<bucket>/<prefix>")
    if not prefix:
        raise SourceError(f"{ref!r}: name the folder inside the bucket "
                          f"({scheme}://{bucket}/<prefix>), not the whole bucket")
    if problem := segment_problem(prefix):
        raise SourceError(f"{ref!r}: {problem}; each part of a bucket folder is a name (not "
                          "empty, '.' or '..', also percent-encoded), since the folder is "
                          f"fetched under the node's cache: write {scheme}://{bucket}/<folder>")
    return f"{scheme}://{bucket}/{prefix}"


def _hub_id(repo_id: str, ref: str) -> str:
    repo_id = repo_id.removeprefix("/").removesuffix("/")
    if problem := segment_problem(repo_id):
        raise SourceError(f"{ref!r} is not a Hugging Face model id: {problem}; write org/name "
                          "(letters, digits, '-', '_', '.')")
    if not HUB_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise SourceError(f"{ref!r} is not a Hugging Face model id (org/name: letters, digits, "
                          "'-', '_', '.'); a local folder is a bare name under "
                          "MESH_MODELS_DIR or a path (/abs/path, ./relative)")
    return repo_id


def _check_revision(source: Source, field: str = "revision") -> None:
    if source.revision is None:
        raise SourceError(f"{source.ref!r} is a Hugging Face id with no revision: pin the "
                          f"commit every replica downloads with `{field}: <40-hex commit "
                          "hash>` (the hub's 'main' moves; HfApi().model_info(id).sha gives "
                          "today's)")
    if not COMMIT_HASH.match(source.revision):
        raise SourceError(f"{source.ref!r}: revision {source.revision!r} is not pinned: a "
                          "branch or a tag can move between two replicas' starts; give the "
                          "full 40-hex commit hash")
