"""Read Serve config files and find the mesh's parts in them.

A Serve config (what ``serve deploy`` takes) is checked with Ray's own schema
(``ray.serve.schema.ServeDeploySchema``); this module then pulls out the ``MeshRouter``
user_config and the variant applications, so the CLI, tests and scripts share one reader.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROUTER_IMPORT_PATH = "serve_app.router:build_app"
REPLICA_IMPORT_PATH = "serve_app.replica:build_app"
ROUTER_DEPLOYMENT = "MeshRouter"
REPLICA_DEPLOYMENT = "LLMReplica"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def on_sim_engine(cfg: dict[str, Any], defaults: dict[str, Any] | None = None, **sim: Any
                  ) -> dict[str, Any]:
    """A copy of Serve config ``cfg`` with every variant application on the simulated engine
    (tests and benchmarks only): ``args.engine: sim`` and ``args.sim`` = ``defaults``, then
    the variant's own ``args.sim``, then ``sim``."""
    cfg = copy.deepcopy(cfg)
    for app in cfg.get("applications", []):
        if app.get("import_path") == REPLICA_IMPORT_PATH:
            app["args"] = {**app["args"], "engine": "sim",
                           "sim": {**(defaults or {}), **app["args"].get("sim", {}), **sim}}
    return cfg


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file into a dict (duplicate keys are an error).

    Raises:
        ValueError: not UTF-8 text, not YAML, duplicate keys, or not a mapping at the top
            level; the message starts with ``path``.
    """
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file: byte {e.start} is not UTF-8 (a Serve "
                         "config is YAML text; is this the file you meant?)") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a Serve config must be a mapping with `applications:`")
    return data


def applications(config: dict[str, Any]) -> list[dict[str, Any]]:
    return list(config.get("applications") or [])


def deployment(app: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((d for d in app.get("deployments") or [] if d.get("name") == name), None)


@dataclass
class MeshParts:
    """The mesh-specific parts of a Serve config (raw dicts, positions kept for messages)."""

    router_app: dict[str, Any] | None
    router_user_config: dict[str, Any] | None
    variant_apps: dict[str, dict[str, Any]]  # application name -> application entry
    app_index: dict[str, int]  # application name -> index in `applications`

    def variant(self, name: str | None = None) -> dict[str, Any]:
        """The variant application ``name``, else (None or "") the config's first one (what
        the benchmarks and calibration run against).

        Raises:
            ValueError: no variant application of that name, or none at all.
        """
        if not name:
            name = next(iter(self.variant_apps), None)
        if name not in self.variant_apps:
            raise ValueError(f"no variant application {name!r} in the config (variant "
                             f"applications: {', '.join(self.variant_apps) or 'none'})")
        return self.variant_apps[name]


def mesh_parts(config: dict[str, Any]) -> MeshParts:
    apps = applications(config)
    router = next((a for a in apps if a.get("import_path") == ROUTER_IMPORT_PATH), None)
    router_dep = deployment(router, ROUTER_DEPLOYMENT) if router else None
    return MeshParts(
        router_app=router,
        router_user_config=(router_dep or {}).get("user_config"),
        variant_apps={a["name"]: a for a in apps
                      if a.get("import_path") == REPLICA_IMPORT_PATH and "name" in a},
        app_index={a.get("name"): i for i, a in enumerate(apps)},
    )
