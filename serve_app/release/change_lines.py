"""A change report as people read it (``meshctl diff``, ``validate --against``): one line per
changed leaf, list items one by one, values whole.

:func:`serve_app.release.config_diff.diff_configs` says which changes restart replicas and
which Serve applies in place; it compares a list as one value. Here a list of mappings is
matched item by item on the keys that name an item (``id``, ``name``, ``application``,
``version``: a tenant, an adapter, a variant, an adapter version), so a tenant added to
``tenants`` is one line, ``tenants[id=ops] (unset) -> {...}``, and a weight change is
``variants[application=smollm-v2].weight 10 -> 50``. A list of plain values shows what was
added and removed; a list whose items only moved says so (a route's variant order is its
sticky split's layout). Nothing is cut short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from serve_app.release.config_diff import UNSET, Change

#: Keys that name an item of a list in a Serve config, in the order they are shown.
IDENTITY_KEYS = ("id", "name", "application", "version")


def show(value: Any) -> str:
    """A value as one line: strings as they are, the rest as JSON, ``(unset)`` for none."""
    if value is UNSET:
        return "(unset)"
    return value if isinstance(value, str) else json.dumps(value)


def _identity(item: Any) -> str | None:
    if not isinstance(item, dict):
        return None
    keys = [k for k in IDENTITY_KEYS if k in item]
    return ",".join(f"{k}={show(item[k])}" for k in keys) if keys else None


def _leaves(path: str, old: Any, new: Any) -> Iterator[tuple[str, Any, Any]]:
    """(path, old, new) of each differing leaf under ``path``."""
    if old == new:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            yield from _leaves(f"{path}.{key}", old.get(key, UNSET), new.get(key, UNSET))
        return
    if isinstance(old, list) and isinstance(new, list):
        yield from _list_leaves(path, old, new)
        return
    yield path, old, new


def _list_leaves(path: str, old: list, new: list) -> Iterator[tuple[str, Any, Any]]:
    old_ids, new_ids = [_identity(x) for x in old], [_identity(x) for x in new]
    keyed = all(old_ids + new_ids) and len(set(old_ids)) == len(old_ids) and \
        len(set(new_ids)) == len(new_ids)
    if keyed:
        before, after = dict(zip(old_ids, old)), dict(zip(new_ids, new))
        for key in old_ids + [k for k in new_ids if k not in before]:
            yield from _leaves(f"{path}[{key}]", before.get(key, UNSET), after.get(key, UNSET))
        common = [k for k in old_ids if k in after]
        if common != [k for k in new_ids if k in before]:
            yield f"{path} order", [k for k in old_ids if k in after], \
                [k for k in new_ids if k in before]
        return
    if all(not isinstance(x, (dict, list)) for x in old + new):
        removed = [x for x in old if x not in new]
        added = [x for x in new if x not in old]
        for x in removed:
            yield f"{path}[-]", x, UNSET
        for x in added:
            yield f"{path}[+]", UNSET, x
        if not removed and not added:
            yield f"{path} order", old, new
        return
    yield path, old, new  # items with no name: the list as a whole


def change_lines(change: Change) -> list[str]:
    """The lines of one change: one per differing leaf, or the change's own line for an
    added or removed application."""
    if not change.field:
        return [str(change)]
    verdict = change.kind.replace("_", " ").upper()
    return [f"{change.app}: {path} {show(old)} -> {show(new)}: {verdict} ({change.reason})"
            for path, old, new in _leaves(change.field, change.old, change.new)]


def report_lines(report: dict[str, list[Change]]) -> list[str]:
    """Every change of a :func:`~serve_app.release.config_diff.diff_configs` report, as
    :func:`change_lines`; ``["no changes"]`` for none."""
    return [line for changes in report.values() for c in changes
            for line in change_lines(c)] or ["no changes"]
