"""docs/testing.md's promise table ("Every promise and the test that breaks when it does")
against the tests it names: each test exists, its tier (unit; default: an integration test
CI runs; --all: one marked slow, by its module or itself) is what the table says, and every
promise has a test CI runs."""

from __future__ import annotations

import re

from serve_app.common.paths import REPO_ROOT

TABLE_HEADING = "## Every promise and the test that breaks when it does"
CI_TIERS = {"unit", "default"}


def promise_rows() -> list[tuple[str, list[str], set[str]]]:
    """(promise, test node ids, tiers) per row of the table."""
    text = (REPO_ROOT / "docs" / "testing.md").read_text()
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("promise", "---"):
            continue
        tests = re.findall(r"`(tests/[\w/]+\.py::\w+)`", cells[1])
        rows.append((cells[0], tests, {t.strip() for t in cells[2].split(",")}))
    return rows


def tier_of(node_id: str) -> str:
    """The tier a test runs in, from where it is and its markers.

    Raises:
        AssertionError: the file or the test does not exist.
    """
    path, name = node_id.split("::")
    file = REPO_ROOT / path
    assert file.is_file(), f"{node_id}: no file {path}"
    source = file.read_text()
    found = re.search(rf"^((?:@.*\n)*)(?:async )?def {name}\(", source, re.MULTILINE)
    assert found, f"{node_id}: no test {name} in {path}"
    if path.startswith("tests/unit/"):
        return "unit"
    module_marks = re.search(r"^pytestmark = (.*)$", source, re.MULTILINE)
    if "mark.slow" in found.group(1) or (module_marks and "slow" in module_marks.group(1)):
        return "--all"
    return "default"


def test_the_table_names_tests_that_exist_in_the_tiers_it_says():
    rows = promise_rows()
    assert len(rows) >= 20, rows
    for promise, tests, tiers in rows:
        assert tests, f"no test named for: {promise}"
        assert {tier_of(t) for t in tests} == tiers, (promise, tests, tiers)


def test_every_promise_has_a_test_ci_runs():
    for promise, _, tiers in promise_rows():
        assert tiers & CI_TIERS, f"only under --all: {promise}"


def test_a_slow_test_is_read_as_the_all_tier():
    """The check itself can fail: a test marked slow is not CI's."""
    assert tier_of("tests/integration/test_tenants.py::"
                   "test_a_merged_variant_serves_its_adapter_as_the_lora_path_does") == "--all"
    assert tier_of("tests/integration/test_full_stop.py::test_stop_leaves_nothing_running") \
        == "--all"
