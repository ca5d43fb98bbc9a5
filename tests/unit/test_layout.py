"""The package's layers, read from its source (no imports run): no two modules of
``serve_app`` import each other, even lazily inside a function; ``serve_app/common/`` imports
only the standard library, third-party packages and ``common/`` itself; and the product
imports nothing of the repository around it (``bench/``, ``scripts/``, ``tests/``)."""

from __future__ import annotations

import ast
from pathlib import Path

from serve_app.common.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "serve_app"
OUTSIDE = ("bench", "scripts", "tests", "dashboards")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The modules ``path`` imports, anywhere in it (a package's ``from p import m`` counts
    as ``p.m`` when ``m`` is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (of every package, not only ``serve_app``)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported(path, set(paths)) - {name} for name, path in paths.items()}


def test_no_two_modules_import_each_other():
    graph = import_graph()
    both = sorted(f"{a} <-> {b}" for a, deps in graph.items() for b in deps
                  if a < b and a in graph.get(b, ()))
    assert not both, ("these modules import each other: move what both need into the lower "
                      f"one, or a new small module: {both}")


def test_common_imports_only_common():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith("serve_app.common")
                    for b in deps if b.startswith("serve_app")
                    and not b.startswith("serve_app.common"))
    assert not upward, ("serve_app/common/ may import only the standard library, third-party "
                        f"packages and common/: {upward}")


def test_the_product_imports_nothing_outside_the_package():
    graph = import_graph()
    outside = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                     if b.split(".")[0] in OUTSIDE)
    assert not outside, f"the wheel holds serve_app/ only; these need the repository: {outside}"


#: The most lines a module of the product may have: one concept a module, readable at once.
MAX_MODULE_LINES = 450


def test_no_module_of_the_product_is_over_450_lines():
    long = {str(p.relative_to(REPO_ROOT)): n for p in (REPO_ROOT / "serve_app").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these by concept: {long}"
