"""The LoRA adapter registry (``adapters/manifest.yaml``) and the checks run before serving one.

An adapter is registered once, as ``name`` + ``version``, with the SHA-256 of its weights and
of its LoRA config (the two files vLLM loads), the base model it was trained for, and where
it comes from (``uri``: a local folder, a Hugging Face id with a pinned ``revision``, or
``s3://`` / ``gs://``; :mod:`serve_app.common.sources`). :func:`verify_adapter` checks that it
fits a variant (base model, LoRA rank) and, for a local folder, that the files are the
registered ones (:func:`check_adapter_files`: no pickled weights, a LoRA config, both files'
SHA-256, target modules). What is loaded into vLLM is always a private copy of those two
files, keyed by both hashes and verified again right before every load
(:mod:`serve_app.common.adapter_cache`). Every failure is an :class:`AdapterError` whose
message names the adapter and says how to fix it, with any credential redacted.

The registry is one YAML file: ``adapters/manifest.yaml`` by default, or the variant's
``user_config.adapters_manifest`` (:func:`manifest_source`): a local file, or a bucket object
or a hub file fetched into the node's cache (:func:`~serve_app.common.fetch.fetch_file`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app.common.paths import REPO_ROOT, resolve_model_path, resolve_repo_path
from serve_app.common.redaction import redact
from serve_app.common.sources import (LOCAL, Source, SourceError, model_key, parse_file_source,
                                      parse_source)

#: Default registry location.
MANIFEST_PATH = REPO_ROOT / "adapters" / "manifest.yaml"

#: Modules vLLM can apply a LoRA to in the Llama architecture.
DEFAULT_SUPPORTED_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})

#: File suffixes of pickle-based weight formats (loading them can execute code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
#: What ``scripts/prepare_model.py`` records about a model it built.
MODEL_STAMP = "mesh_model_stamp.json"


class AdapterError(ValueError):
    """An adapter or the manifest is unusable; the message names it and says how to fix it,
    with any credential in it redacted."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class AdapterSpec(BaseModel):
    """One manifest entry: an immutable, checksummed adapter version."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    name: str = Field(min_length=1)
    version: int = Field(ge=1)
    #: The model it was trained for, named as the variants that serve it name theirs: a hub
    #: id (with ``base_model_revision``), a bucket folder, or a local folder's name
    #: (:func:`~serve_app.common.sources.model_key`).
    base_model: str = Field(min_length=1)
    #: The hub commit (40 hex) of a ``base_model`` from the hub; nothing else has one.
    base_model_revision: str | None = None
    #: Where the adapter directory is: a local path (absolute or repo-relative), ``file://``,
    #: a Hugging Face id (``org/name`` or ``hf://org/name``, with ``revision``), or a bucket
    #: folder (``s3://bucket/prefix``, ``gs://bucket/prefix``).
    uri: str = Field(min_length=1)
    #: The hub commit (40 hex) of an adapter from the hub; nothing else has one.
    revision: str | None = None
    rank: int = Field(ge=1)
    target_modules: list[str] = Field(min_length=1)
    #: Hex SHA-256 of ``adapter_model.safetensors``.
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    #: Hex SHA-256 of ``adapter_config.json`` (its ``lora_alpha``, ``r``, modules: they
    #: change what the weights do).
    config_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    #: Free-form record of how the adapter was trained (behaviour, steps, loss, ...).
    training: dict = {}

    @property
    def key(self) -> str:
        """Registry key, ``name@vN``."""
        return adapter_key(self.name, self.version)

    @property
    def files(self) -> dict[str, str]:
        """The files vLLM loads and their registered SHA-256: ``{file name: hex}``."""
        return {CONFIG_FILE: self.config_sha256, WEIGHTS_FILE: self.sha256}

    @property
    def digest(self) -> str:
        """Hex SHA-256 of everything that makes the adapter (each file's name and SHA-256):
        what its private copy is keyed by, so two versions that differ in any file never
        share one."""
        listing = "".join(f"{name} {sha}\n" for name, sha in sorted(self.files.items()))
        return hashlib.sha256(listing.encode()).hexdigest()


def adapter_key(name: str, version: int) -> str:
    """The name of one adapter version, ``name@vN``: its registry key, its LoRA name in vLLM
    and the arm of an adapter version split."""
    return f"{name}@v{version}"


def adapter_name(key: str) -> str:
    """``name@vN`` -> ``name``."""
    return key.partition("@")[0]


def sha256_file(path: Path | str) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(path: Path | None = None) -> dict[str, AdapterSpec]:
    """Read the registry into ``{"name@vN": AdapterSpec}``, in file order.

    Args:
        path: manifest file; defaults to ``<repo>/adapters/manifest.yaml``.

    Raises:
        AdapterError: the file is missing or not YAML, lacks a top-level ``adapters:`` list, an
            entry breaks the schema (the message names ``adapters[i]`` and the field), or two
            entries share a name and version.
    """
    path = Path(path) if path is not None else MANIFEST_PATH
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise AdapterError(f"cannot read adapter manifest {path}: {e}") from e
    entries = (data or {}).get("adapters") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise AdapterError(f"{path}: expected a top-level 'adapters:' list of entries")

    specs: dict[str, AdapterSpec] = {}
    first_index: dict[str, int] = {}
    for i, entry in enumerate(entries):
        try:
            spec = AdapterSpec.model_validate(entry)
        except ValidationError as e:
            problems = "; ".join(
                f"field '{'.'.join(str(p) for p in err['loc']) or '<entry>'}': {err['msg']}"
                for err in e.errors())
            raise AdapterError(f"{path}: adapters[{i}] is invalid: {problems}") from None
        if spec.key in specs:
            raise AdapterError(
                f"{path}: adapters[{i}] duplicates {spec.key} (first at "
                f"adapters[{first_index[spec.key]}]); registered versions are immutable, "
                "so give the new adapter a new version number")
        specs[spec.key] = spec
        first_index[spec.key] = i
    return specs


def manifest_file(ref: str | None, *, config_dir: Path | None = None) -> Path:
    """The local file of a variant's ``user_config.adapters_manifest``, fetched first when it
    is remote. Blocking.

    - None: ``<repo>/adapters/manifest.yaml``;
    - a bucket object (``s3://bucket/key``, ``gs://bucket/key``) or a hub file
      (``hf://org/name@<commit>/path``): fetched into the node's cache
      (:func:`~serve_app.common.fetch.fetch_file`), the same file on every node;
    - an absolute path or ``file:///abs/path``: that file;
    - a relative path: from ``config_dir``, the folder of the config file that names it
      (``meshctl`` knows it); without one (a replica: ``serve deploy`` gives it no file),
      from the repository root.

    Raises:
        AdapterError: a malformed reference, or a remote file that could not be fetched.
    """
    if ref is None:
        return MANIFEST_PATH
    try:
        source = parse_file_source(ref)
    except SourceError as e:
        raise AdapterError(f"adapter registry {e}") from None
    if source.kind == LOCAL:
        path = Path(source.location)
        return path if path.is_absolute() else (config_dir or REPO_ROOT) / path
    from serve_app.common.fetch import FetchError, fetch_file

    try:
        return fetch_file(source, what="adapter manifest")
    except FetchError as e:
        raise AdapterError(f"adapter registry: {e}") from None


def resolve_uri(uri: str) -> Path:
    """Turn a local adapter ``uri`` into a directory path (existence is not checked).

    Accepts absolute paths, repo-relative paths and ``file:///abs/path``.

    Raises:
        AdapterError: a remote source (``hf://``, ``s3://``, ``gs://``: fetched into the node's
            cache, :func:`serve_app.common.adapter_cache.private_copy`), another scheme, or a
            ``file://`` URI with a host part.
    """
    parts = urlsplit(uri)
    if parts.scheme == "":
        return resolve_repo_path(uri)
    try:
        source = parse_source(uri)
    except SourceError as e:
        raise AdapterError(f"adapter uri {e}") from None
    if source.kind != LOCAL:
        raise AdapterError(f"adapter uri {uri!r} is remote: it is fetched into the node's "
                           "cache, not read in place")
    return Path(source.location)


def adapter_source(spec: "AdapterSpec") -> Source:
    """The :class:`~serve_app.common.sources.Source` of ``spec``. A ``uri`` without a scheme
    is a local path (absolute or repo-relative), unless ``revision`` makes it a hub id.

    Raises:
        AdapterError: a malformed uri, a hub id without a pinned revision, a revision on
            anything else.
    """
    try:
        if urlsplit(spec.uri).scheme in ("", "file") and spec.revision is None:
            return parse_source(str(resolve_uri(spec.uri)))
        return parse_source(spec.uri, spec.revision)
    except (SourceError, AdapterError) as e:
        raise AdapterError(f"adapter {spec.key}: {e}") from None


def base_model_problem(spec: AdapterSpec, *, base_model: str,
                       base_revision: str | None = None) -> str | None:
    """Why ``spec`` was not trained for a variant's model, or None: its ``base_model`` (and
    ``base_model_revision``) and the variant's ``args.model`` (and ``args.revision``) name
    the same model by :func:`~serve_app.common.sources.model_key`: the same hub id at the
    same commit, the same bucket folder, or local folders of the same name."""
    try:
        wanted = model_key(spec.base_model, spec.base_model_revision,
                           revision_field="base_model_revision")
    except SourceError as e:
        return f"its base_model {e}"
    try:
        served = model_key(base_model, base_revision)
    except SourceError as e:
        return f"the variant's model {e}"
    if wanted == served:
        return None
    named = f" ({base_model})" if base_model != served else ""
    return (f"trained for {wanted!r}, but this variant serves {served!r}{named}; declare it "
            f"on a variant of {wanted!r}")


def fit_problem(spec: AdapterSpec, *, base_model: str, max_lora_rank: int,
                base_revision: str | None = None) -> str | None:
    """Why a variant's engine cannot serve ``spec``, or None when it fits. The one check of
    adapter against engine, used by ``meshctl validate`` (from the config), by
    :func:`verify_adapter` and by the replica (from the running engine).

    Args:
        base_model: the variant's ``args.model`` (:func:`base_model_problem`).
        max_lora_rank: the engine's ``max_lora_rank``; 0 when LoRA is off.
        base_revision: the variant's ``args.revision`` (a hub model's commit).
    """
    if not max_lora_rank:
        return ("the variant's engine has LoRA off; set engine_args.enable_lora: true (an "
                "args change: do it blue/green)")
    if problem := base_model_problem(spec, base_model=base_model, base_revision=base_revision):
        return problem
    if spec.rank > max_lora_rank:
        return (f"rank {spec.rank} is over this variant's max_lora_rank={max_lora_rank}; raise "
                f"max_lora_rank in the variant's engine args or retrain with "
                f"r<={max_lora_rank}")
    return None


def verify_adapter(spec: AdapterSpec, *, base_model: str, max_lora_rank: int,
                   supported_modules: frozenset = DEFAULT_SUPPORTED_MODULES,
                   base_revision: str | None = None) -> Path | None:
    """Check that an adapter can be served by a variant; return its local directory (None
    for a remote source, whose files are checked when its private copy is made).

    Checks, in order: its source parses (:func:`adapter_source`); a local one's files pass
    :func:`check_adapter_files`; its base model is the variant's and its rank fits
    ``max_lora_rank`` (:func:`fit_problem`).

    Args:
        spec: the manifest entry.
        base_model: the variant's ``args.model`` (e.g. ``smollm2-135m-instruct``).
        max_lora_rank: the variant engine's ``max_lora_rank``.
        supported_modules: module names the engine can apply a LoRA to.
        base_revision: the variant's ``args.revision`` (a hub model's commit).

    Raises:
        AdapterError: the first failed check, with the reason and the fix.
    """
    source = adapter_source(spec)
    path = None
    if source.kind == LOCAL:
        path = Path(source.location)
        check_adapter_files(spec, path, supported_modules)
    if problem := fit_problem(spec, base_model=base_model, max_lora_rank=max_lora_rank,
                              base_revision=base_revision):
        raise AdapterError(f"adapter {spec.key}: {problem}")
    return path


def check_adapter_files(spec: AdapterSpec, path: Path,
                        supported_modules: frozenset = DEFAULT_SUPPORTED_MODULES) -> None:
    """Check an adapter directory against its manifest entry: it exists; it holds no
    pickle-format weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.pkl``); ``adapter_config.json``
    exists, its SHA-256 is the manifest's ``config_sha256``, and it is valid JSON with
    ``peft_type: LORA``, the manifest's rank and supported target modules;
    ``adapter_model.safetensors`` exists and its SHA-256 is the manifest's ``sha256``.

    Raises:
        AdapterError: the first failed check, with the reason and the fix.
    """
    def fail(reason: str) -> AdapterError:
        return AdapterError(f"adapter {spec.key}: {reason}")

    if not path.is_dir():
        raise fail(f"directory {path} (uri {spec.uri!r}) does not exist; train it with "
                   "scripts/train_adapter.py or fix 'uri' in adapters/manifest.yaml")

    check_no_pickles(spec, path)

    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise fail(f"{CONFIG_FILE} is missing from {path}; save the adapter with "
                   "peft's save_pretrained()")
    actual = sha256_file(config_path)
    if actual != spec.config_sha256:
        raise fail(f"SHA-256 mismatch for {config_path}: manifest config_sha256 "
                   f"{spec.config_sha256[:12]}..., file {actual[:12]}...; the config changed "
                   "after registration (its lora_alpha, r or modules change what the weights "
                   "do): restore it, or register it as a new version")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise fail(f"{config_path} is not valid JSON ({e}); re-save the adapter") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise fail(f"{config_path} has peft_type {found!r}; only LoRA adapters "
                   "(peft_type 'LORA') can be served")

    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise fail(f"{WEIGHTS_FILE} is missing from {path}; save the adapter with "
                   "save_pretrained(out, safe_serialization=True)")
    actual = sha256_file(weights)
    if actual != spec.sha256:
        raise fail(f"SHA-256 mismatch for {weights}: manifest {spec.sha256[:12]}..., file "
                   f"{actual[:12]}...; the weights changed after registration: restore them, or "
                   "register the new weights as a new version")

    rank = config.get("r")
    if rank != spec.rank:
        raise fail(f"{CONFIG_FILE} has r={rank} but the manifest says rank={spec.rank}; "
                   "fix 'rank' in adapters/manifest.yaml")

    modules = config.get("target_modules")
    if not isinstance(modules, list):
        raise fail(f"{CONFIG_FILE} target_modules is {modules!r}; expected an explicit list of "
                   "module names")
    unsupported = sorted(set(modules) - set(supported_modules))
    if unsupported:
        raise fail(f"target modules {unsupported} are not supported (supported: "
                   f"{sorted(supported_modules)}); retrain targeting only supported modules")


def check_no_pickles(spec: AdapterSpec, path: Path) -> None:
    """Refuse a folder holding pickle-format weights (``*.bin``, ``*.pt``, ``*.pth``,
    ``*.pkl``: loading them can run code).

    Raises:
        AdapterError: one is there; the message lists them.
    """
    pickled = sorted(str(p.relative_to(path)) for p in path.rglob("*")
                     if p.is_file() and p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise AdapterError(f"adapter {spec.key}: refusing pickle-format weights {pickled} in "
                           f"{path}: pickled weights can run code; save with "
                           "safe_serialization=True and remove those files")


def merged_adapter(model: str) -> str | None:
    """The adapter version (``name@vN``) merged into ``model``'s weights, from the stamp
    ``scripts/prepare_model.py --merge-adapter`` writes (``"source": "<base> + name@vN (peft
    merge_and_unload)"``); None for a model without one, or one not found here.

    A variant whose model this names serves requests for that adapter version from its own
    weights, with no LoRA (``routes.<route>.merged``, :mod:`serve_app.server.serving`)."""
    try:
        stamp = json.loads((Path(resolve_model_path(model)) / MODEL_STAMP).read_text())
    except (OSError, ValueError):  # no such model here, no stamp, or not JSON
        return None
    match = re.search(r" \+ (\S+@v\d+) \(peft merge_and_unload\)", str(stamp.get("source", "")))
    return match.group(1) if match else None
