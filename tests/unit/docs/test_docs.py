"""The manual stays true to the code: the error-code reference (``docs/errors.md``) lists every
code the code can send and is what the catalog generates; every metric the docs name exists,
under the name Prometheus shows; every relative link of README.md, CONTRIBUTING.md and
docs/*.md resolves, anchors included. No cluster."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from serve_app.common.errors import ERROR_CODES
from serve_app.common.paths import REPO_ROOT
from scripts.error_reference import DOC, codes_in_code, render

PAGES = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md",
         *sorted((REPO_ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


# -- error codes --------------------------------------------------------------------------------

def test_every_code_the_code_sends_is_in_the_reference():
    missing = {code: where for code, where in codes_in_code().items() if code not in ERROR_CODES}
    assert not missing, ("codes the code can send, missing from serve_app/common/errors.py "
                         f"ERROR_CODES (then run python scripts/error_reference.py): "
                         f"{missing}")


def test_every_code_in_the_reference_is_sent():
    """A code no longer in the code leaves the reference (vLLM's own phrases excepted)."""
    sent = codes_in_code()
    stale = [c for c, e in ERROR_CODES.items() if c not in sent and "vLLM" not in e.source]
    assert not stale


def test_the_committed_reference_is_current():
    assert DOC.read_text() == render(), ("docs/errors.md is stale: run "
                                         "python scripts/error_reference.py")


def test_the_readme_links_the_reference():
    assert "](docs/errors.md)" in (REPO_ROOT / "README.md").read_text()


# -- metrics -------------------------------------------------------------------------------------

def mesh_metrics() -> dict[str, str]:
    """Metric name -> Counter / Gauge / Histogram, as the package defines them."""
    kinds = {}
    for path in (REPO_ROOT / "serve_app").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("Counter", "Gauge", "Histogram") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("mesh_")):
                kinds[node.args[0].value] = node.func.id
    return kinds


def prometheus_names() -> set[str]:
    """Every series name the mesh's metrics have in Prometheus (Ray adds ``ray_``; a counter's
    samples end in ``_total``, a histogram's in ``_bucket``/``_sum``/``_count``)."""
    names = set()
    for name, kind in mesh_metrics().items():
        if kind == "Counter":
            names.add(f"ray_{name}_total")
        elif kind == "Histogram":
            names |= {f"ray_{name}{s}" for s in ("", "_bucket", "_sum", "_count")}
        else:
            names.add(f"ray_{name}")
    return names


def vllm_metrics() -> set[str]:
    """vLLM's metric names (``vllm:...``), read from its metrics source."""
    import vllm

    root = Path(vllm.__file__).parent / "v1" / "metrics"
    return {m for path in root.glob("*.py") for m in re.findall(r'"(vllm:[a-z0-9_]+)"',
                                                                path.read_text())}


METRIC = re.compile(r"(?<![\w/.-])(ray_mesh_|ray_vllm_|mesh_|vllm:)([a-z0-9_]*)(\*?)")


def named_metrics(text: str) -> list[str]:
    """Metric names in a page's code spans (``...``)."""
    spans = re.findall(r"`([^`\n]+)`", text)
    return [m.group(1) + m.group(2) + m.group(3) for s in spans for m in METRIC.finditer(s)]


def metric_problem(name: str, mesh: set[str], bare: set[str], vllm: set[str]) -> str | None:
    if name.endswith("*"):
        prefix = name[:-1]
        ok = any(n.startswith(prefix) for n in mesh) or (
            prefix.startswith("ray_vllm_") and any(
                f"ray_{v.replace(':', '_')}".startswith(prefix) for v in vllm))
        return None if ok or prefix in ("ray_mesh_", "ray_vllm_") else "no metric has it"
    if name.startswith("ray_mesh_"):
        return None if name in mesh else "not a metric of the mesh as Prometheus names it"
    if name.startswith("mesh_"):
        if name in bare or name.removesuffix("_total") in bare:
            return "write it as Prometheus shows it (ray_..., _total for a counter)"
        return None  # not a metric (mesh_parts, mesh_model_stamp.json, ...)
    if name.startswith("ray_vllm_"):
        base = "vllm:" + re.sub(r"_(total|bucket|sum|count)$", "", name[len("ray_vllm_"):])
        return None if base in vllm or f"{base}_total" in vllm else "not one of vLLM's metrics"
    return None if name in vllm else "not one of vLLM's metrics"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_metric_a_page_names_exists_under_one_name(page):
    mesh, bare, vllm = prometheus_names(), set(mesh_metrics()), vllm_metrics()
    wrong = {n: p for n in named_metrics(page.read_text())
             if (p := metric_problem(n, mesh, bare, vllm))}
    assert not wrong, wrong


# -- links ---------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        title = re.sub(r"[^\w\- ]", "", title.replace("`", ""))
        out.add(title.replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO_ROOT) if dest.is_relative_to(REPO_ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, broken


# -- a manual, not a lab notebook -----------------------------------------------------------------

#: "issue 26", "issues 29 and 31", "issue #4", "the issue's goal": a reader of the docs has no
#: tracker to look them up in; say what the mesh does, and put dated runs in docs/history.md.
ISSUE = re.compile(r"\bissues?\s+#?\d+|\bissue\s*#\d+|\bthe\s+issue\b|\bissue's\b", re.I)


def issue_mentions(text: str) -> list[str]:
    """Line number and line of each mention of an issue, a mention wrapped over two lines
    included."""
    return [f"{text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group().split())}"
            for m in ISSUE.finditer(text)]


def test_issue_mentions_are_found():
    assert issue_mentions("as issue 26 asks\nand issue\n31's count; issue #4; the issue's goal") == [
        "1: issue 26", "2: issue 31", "3: issue #4", "3: the issue"]
    assert issue_mentions("an issue with the adapter; no issues; issued 3 keys") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_page_names_an_issue(page):
    assert not (found := issue_mentions(page.read_text())), (
        f"{rel(page)} names issues {found}: say what the mesh does now; dated runs and "
        "experiments go to docs/history.md")


#: A date, as the docs write one.
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
#: The pages of latest results: each heading's table, introduced by one line that gives its
#: run's date, host and command; every earlier run is in docs/history.md.
RESULT_PAGES = [REPO_ROOT / "docs" / "benchmarks.md", REPO_ROOT / "docs" / "scale.md"]


def dated_lab_notes(text: str) -> list[str]:
    """What keeps a results page from being one current table per heading: a date outside a
    results header (a paragraph that starts ``**DATE**``), a header that names no host ("this
    host", or "simulated") or no command (a code span running ``python`` or ``pytest``), a
    header not followed by its table, and a second header under one heading."""
    problems, headers_here, at = [], 0, 0
    paragraphs = re.split(r"\n\s*\n", text)
    for i, para in enumerate(paragraphs):
        at = text.index(para, at)
        line = text.count("\n", 0, at) + 1
        if para.startswith("#"):
            headers_here = 0
        if para.startswith("```"):
            continue
        dates = DATE.findall(para)
        if not dates:
            continue
        if not re.match(r"\*\*20\d\d-\d\d-\d\d\*\*", para) or len(dates) > 1:
            problems.append(f"{line}: a date outside a results header: {dates}")
            continue
        headers_here += 1
        if headers_here > 1:
            problems.append(f"{line}: a second dated table under one heading")
        if "this host" not in para and "simulated" not in para:
            problems.append(f"{line}: the header names no host")
        if not re.search(r"`[^`]*\b(python|pytest)\b[^`]*`|the (same )?command", para):
            problems.append(f"{line}: the header names no command")
        following = paragraphs[i + 1] if i + 1 < len(paragraphs) else ""
        if not following.startswith("|"):
            problems.append(f"{line}: the header is not followed by its table")
    return problems


def test_dated_lab_notes_are_found():
    assert dated_lab_notes("## A\n\n**2026-11-30**, this host, `python scripts/bench.py`:\n\n"
                           "| a |\n|---|\n") == []
    assert dated_lab_notes("## A\n\nOn a slower day (2026-12-02) it ran.\n") == [
        "3: a date outside a results header: ['2026-12-02']"]
    assert dated_lab_notes("## A\n\n**2026-11-30**, this host, `python x.py`:\n\n| a |\n\n"
                           "**2026-12-01**, this host, `python x.py`:\n\n| b |\n") == [
        "7: a second dated table under one heading"]
    assert dated_lab_notes("## A\n\n**2026-11-30**, on a laptop:\n\nNo table.\n") == [
        "3: the header names no host", "3: the header names no command",
        "3: the header is not followed by its table"]


@pytest.mark.parametrize("page", RESULT_PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_a_results_page_keeps_one_current_table_per_heading(page):
    assert not (found := dated_lab_notes(page.read_text())), (
        f"{rel(page)}: {found}: keep one table of the latest run per heading, introduced by "
        "its date, host and command; move earlier runs and dated notes to docs/history.md")
