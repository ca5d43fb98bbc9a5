"""The suite's order (tests/conftest.py): MODULE_ORDER ranks integration modules only, so a
unit module that shares an integration module's name (``tests/unit/bench/test_chaos.py`` and
``tests/integration/test_chaos.py``) still runs with the unit tests, first."""

from __future__ import annotations

from types import SimpleNamespace

from tests import conftest


def item(module: str) -> SimpleNamespace:
    """A collected test as the hook reads it: its module's dotted name, no markers."""
    return SimpleNamespace(module=SimpleNamespace(__name__=module), nodeid=module,
                           get_closest_marker=lambda name: None)


def test_unit_modules_run_first_whatever_their_name_and_integration_in_module_order():
    items = [item("tests.integration.test_chaos"), item("tests.unit.bench.test_chaos"),
             item("tests.integration.test_replica_routing"), item("tests.unit.test_layout")]
    conftest.pytest_collection_modifyitems(SimpleNamespace(), items)
    assert [i.module.__name__ for i in items] == [
        "tests.unit.bench.test_chaos", "tests.unit.test_layout",
        "tests.integration.test_replica_routing", "tests.integration.test_chaos"]
