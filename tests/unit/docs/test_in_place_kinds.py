"""docs/in-place-changes.md lists exactly the in-place kinds the soak of
tests/integration/test_in_place.py applies (tests/support/in_place.py)."""

from __future__ import annotations

import re

from serve_app.common.paths import REPO_ROOT
from tests.support.in_place import CHANGES


def test_the_guide_lists_every_kind_the_soak_applies_and_no_other():
    guide = (REPO_ROOT / "docs" / "in-place-changes.md").read_text()
    table = guide[guide.index("## The kinds"):]
    listed = {m.group(1) for m in re.finditer(r"^\| ([^|]+?) \| ", table, re.M)} - {"kind"}
    applied = {kind for kind, _ in CHANGES}
    assert listed == applied, {"not applied": listed - applied, "not listed": applied - listed}
