"""Registered copies of the demo adapters, for tests and benchmarks of many adapters.

The demo registry has two trained adapters (``acme-support``, ``globex-report``). A copy is a
new manifest entry (its own name, version 1) pointing at a demo adapter's directory with the
same SHA-256, so it passes every check :func:`~serve_app.common.adapters.verify_adapter` runs
and answers with that adapter's behaviour. Copies go in a registry of their own (a temporary
directory), never in ``adapters/manifest.yaml``.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from serve_app.common.adapters import load_manifest, resolve_uri

#: The demo adapters the copies take turns at, and the name each copy's behaviour comes from.
SOURCES = ("acme-support@v1", "globex-report@v1")


def copy_name(i: int, source: str) -> str:
    """The name of copy ``i`` of ``source`` (``name@vN``): ``acme-support-c07``."""
    return f"{source.partition('@')[0]}-c{i:02d}"


def register_copies(k: int, registry: Path) -> tuple[Path, list[str]]:
    """Write ``registry/manifest.yaml`` with ``k`` copies, alternating over :data:`SOURCES`.

    Returns:
        The manifest path and the copies' names, in order (copy ``i`` of ``SOURCES[i % 2]``).

    Raises:
        ValueError: ``k`` < 1.
        serve_app.common.adapters.AdapterError: the demo registry is unreadable.
    """
    if k < 1:
        raise ValueError(f"need at least one copy, not {k}")
    demo = load_manifest()
    entries, names = [], []
    for i in range(k):
        source = demo[SOURCES[i % len(SOURCES)]]
        name = copy_name(i, source.key)
        entries.append({**source.model_dump(), "name": name, "version": 1,
                        "uri": str(resolve_uri(source.uri))})
        names.append(name)
    registry.mkdir(parents=True, exist_ok=True)
    manifest = registry / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"adapters": entries}, sort_keys=False))
    return manifest, names
