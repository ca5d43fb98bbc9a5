"""Where the mesh finds models and adapters on disk.

Serve configs name models by a short relative name (``smollm2-135m-instruct``) so the same
file works on every machine; this module turns that name into a directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: The repository root (the package is installed in editable mode from it).
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Default embedded model, built by ``scripts/prepare_model.py``.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def models_dir() -> Path:
    """Directory holding prepared models: ``$MESH_MODELS_DIR`` or ``<repo>/models``."""
    return Path(os.environ.get("MESH_MODELS_DIR", REPO_ROOT / "models"))


def cache_root() -> Path:
    """The node's cache of the mesh (downloaded models and adapters, engine-check records):
    ``$MESH_CACHE_DIR``, else ``~/.cache/model-mesh``, else the system's temporary directory
    where the home directory cannot be written."""
    if "MESH_CACHE_DIR" in os.environ:
        return Path(os.environ["MESH_CACHE_DIR"])
    home = Path.home() / ".cache" / "model-mesh"
    if os.access(home if home.exists() else Path.home(), os.W_OK):
        return home
    return Path(tempfile.gettempdir()) / "model-mesh"


def model_identity(model: str) -> str:
    """A base model's short name, whatever the config calls it or wherever it comes from: the
    last part of its path, hub id or bucket prefix (``smollm2-135m-instruct`` for
    ``/srv/models/smollm2-135m-instruct/``, ``org/smollm2-135m-instruct`` and
    ``s3://bucket/models/smollm2-135m-instruct``), for labels and the names of models made
    from it. An adapter's ``base_model`` is matched by the full id and revision instead
    (:func:`~serve_app.common.sources.model_key`)."""
    from serve_app.common.sources import identity_of

    return identity_of(model)


def resolve_model_path(model: str) -> str:
    """Map a config's ``model`` value to a local directory.

    Absolute paths and paths that exist are returned unchanged; anything else is looked up
    under :func:`models_dir`.

    Raises:
        FileNotFoundError: the model directory does not exist; the message says how to build it.
    """
    candidate = Path(model)
    if candidate.is_absolute() or candidate.exists():
        path = candidate
    else:
        path = models_dir() / model
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {model!r} not found at {path} (no config.json). "
            "Build the embedded model with `python scripts/prepare_model.py`, "
            "or set MESH_MODELS_DIR to the folder that holds it; weights from the hub or a "
            "bucket: model: org/name with revision: <commit>, or s3://bucket/prefix "
            "(docs/gpu-fleet.md)."
        )
    return str(path)


def resolve_repo_path(path: str) -> Path:
    """Resolve a repository-relative path (as written in configs and manifests)."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p
