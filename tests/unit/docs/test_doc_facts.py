"""Facts the docs state once, checked against the code that decides them: each command's exit
codes (docs/ci.md), what restarts and what changes in place (docs/base-swaps.md), and the
adapter events (docs/observability.md). No cluster."""

from __future__ import annotations

import re

from serve_app.cli import REFUSED_EXIT, USAGE_EXIT
from serve_app.common.paths import REPO_ROOT
from serve_app.release import rollout_watch
from serve_app.release.config_diff import (CODE_VERSION_DEPLOYMENT_OPTIONS,
                                           LIGHTWEIGHT_DEPLOYMENT_OPTIONS)
from serve_app.server.lora import EVENTS

DOCS = REPO_ROOT / "docs"


def table(text: str, header_starts: str) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header_starts``."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(header_starts))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_the_exit_code_table_is_what_the_commands_return():
    rows = {int(r[0]): r for r in table((DOCS / "ci.md").read_text(), "| code | `meshctl`")}
    meshctl = {0: "done", REFUSED_EXIT: "refused", USAGE_EXIT: "could not run"}
    for code, name in meshctl.items():
        assert rows[code][1].startswith(name), (code, rows[code][1])
    assert all(not rows[c][1] for c in rows if c not in meshctl)
    for code, name in rollout_watch.EXIT_CODES.items():
        assert rows[code][2].startswith(name), (code, rows[code][2])
    assert set(rows) == set(rollout_watch.EXIT_CODES) | set(meshctl)


def test_the_readme_states_no_exit_code_of_its_own():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "](docs/ci.md#exit-codes)" in readme
    assert not re.search(r"exits? \d", readme)


def names(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_*]+)`", text))


def test_base_swaps_lists_in_place_exactly_the_lightweight_options():
    """``request_router_config`` is in Serve's code version: a restart, not in place."""
    text = (DOCS / "base-swaps.md").read_text()
    in_place = re.search(r"^- `IN PLACE`:(.*?)^- ", text, re.S | re.M).group(1)
    restart = re.search(r"^- `RESTART`:(.*?)^- ", text, re.S | re.M).group(1)
    listed = names(in_place) - {"user_config", "route_prefix", "reconfigure",
                                "LIGHTWEIGHT_DEPLOYMENT_OPTIONS"}
    expanded = {o for o in LIGHTWEIGHT_DEPLOYMENT_OPTIONS
                if o in listed or any(p.endswith("*") and o.startswith(p[:-1]) for p in listed)}
    assert expanded == LIGHTWEIGHT_DEPLOYMENT_OPTIONS - {"user_config"}
    assert not listed & CODE_VERSION_DEPLOYMENT_OPTIONS
    assert "request_router_config" in names(restart)
    assert "request_router_config" in names((DOCS / "in-place-changes.md").read_text())


def test_the_adapter_events_are_listed_once_and_whole():
    row = next(l for l in (DOCS / "observability.md").read_text().splitlines()
               if l.startswith("| `ray_mesh_adapter_events_total`"))
    assert set(re.findall(r"`([a-z]+)` \(", row)) == set(EVENTS)
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "observability.md":
            continue
        for line in page.read_text().splitlines():
            if "ray_mesh_adapter_events_total" in line:
                listed = {e for e in EVENTS if f"`{e}`" in line}
                assert len(listed) < 3, (page.name, line)  # a list of events: link the table


def test_another_tenant_s_adapter_is_a_404_wherever_a_doc_says_what_it_gets():
    """The planner answers a tenant that names another tenant's adapter as for one that does
    not exist, 404 ``model_not_found`` (tests/unit/request/test_planner.py), so a caller cannot
    learn which adapters exist: no page may promise it a 403."""
    said = []
    for page in [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if page.name == "history.md":  # dated notes: what was true then
            continue
        for m in re.finditer(r"\b(another tenant|other tenant|globex)\b[^.|;]{0,40}?\b(4\d\d)\b",
                             page.read_text(), re.S | re.I):
            said.append((page.name, m.group(0), int(m.group(2))))
    assert said, "no page says what another tenant's adapter gets"
    assert [s for s in said if s[2] != 404] == []
