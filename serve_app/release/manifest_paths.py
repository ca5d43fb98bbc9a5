"""A variant's relative ``adapters_manifest``, read from the folder of the config that names it.

Serve hands a replica its ``user_config``, never the file it came from, so a replica reads a
relative ``adapters_manifest`` from the repository root
(:func:`~serve_app.common.adapters.manifest_file` without a folder). ``meshctl validate``,
``diff`` and ``deploy`` know the file: they make every relative ``adapters_manifest`` of a
config absolute, from the config file's folder (:func:`with_config_folder`), before they
check, compare or deploy it; ``meshctl deploy`` hands Serve a copy of the file with those
absolute paths (:func:`deployable_copy`). A config and its registry can then sit side by side
anywhere on the host that runs Ray. Bucket and hub URIs (``s3://``, ``gs://``,
``hf://org/name@<commit>/path``) and absolute paths are left as they are.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import yaml

from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment, mesh_parts
from serve_app.common.sources import LOCAL, SourceError, parse_file_source


def relative_manifests(config: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """``(user_config, adapters_manifest)`` of every variant whose ``LLMReplica``
    ``user_config`` names a relative local ``adapters_manifest`` (the dicts of ``config``)."""
    found = []
    try:
        apps = [(deployment(app, REPLICA_DEPLOYMENT) or {})
                for app in mesh_parts(config).variant_apps.values()]
    except (AttributeError, TypeError):  # not the shape of a Serve config: validate says so
        return []
    for dep in apps:
        user_config = dep.get("user_config") if isinstance(dep, dict) else None
        ref = user_config.get("adapters_manifest") if isinstance(user_config, dict) else None
        if not isinstance(ref, str):
            continue
        try:
            source = parse_file_source(ref)
        except SourceError:
            continue  # validate reports it
        if source.kind == LOCAL and not Path(source.location).is_absolute():
            found.append((user_config, ref))
    return found


def with_config_folder(config: dict[str, Any], config_path: str | Path) -> dict[str, Any]:
    """``config`` with each relative ``adapters_manifest`` made absolute from the folder of
    ``config_path`` (``config`` itself when it has none; else a copy)."""
    if not relative_manifests(config):
        return config
    out = copy.deepcopy(config)
    folder = Path(config_path).resolve().parent
    for user_config, ref in relative_manifests(out):
        user_config["adapters_manifest"] = str(folder / ref)
    return out


def deployable_copy(config_path: str | Path) -> Path:
    """The file ``meshctl deploy`` hands ``serve deploy``: ``config_path`` itself, or, when
    it names a relative ``adapters_manifest``, a copy in a temporary folder with those paths
    made absolute (:func:`with_config_folder`), under the same file name."""
    config = yaml.safe_load(Path(config_path).read_text())
    resolved = with_config_folder(config, config_path)
    if resolved is config:
        return Path(config_path)
    out = Path(tempfile.mkdtemp(prefix="meshctl-deploy-")) / Path(config_path).name
    out.write_text(yaml.safe_dump(resolved, sort_keys=False))
    return out
