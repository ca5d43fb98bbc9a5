"""Every Serve config the docs show passes ``meshctl validate``, and the recipes' ``meshctl diff``
says what the recipe says. No cluster: the real CLI on files.

Which ```yaml blocks of README.md and docs/*.md are checked (the rule):

- a block whose top level is a mapping with ``applications`` is a complete Serve config:
  ``meshctl validate`` must accept it, vLLM's engine-arg checks included;
- a fragment preceded by ``<!-- docs-check: BASE PATH -->`` is a recipe's change: it is
  added to the shipped config ``BASE`` at ``PATH`` (dotted; ``name[x]`` is the item of the list
  ``name`` whose ``name`` is ``x``): a list gets the fragment's items appended, a mapping its
  keys set. ``<the hash>`` stands for an API key's SHA-256. ``meshctl validate`` must accept
  the result (vLLM's checks skipped: the shipped base passes them in
  ``tests/unit/release/test_validate_catalog.py``). When the recipe's next ```bash block runs
  ``meshctl diff``, ``meshctl diff BASE RESULT`` must exit 0, and a comment ``# one line: X``
  there must match exactly one change line, which contains ``X``;
- every other block is a fragment (a field, a tenant, a manifest entry) and is skipped.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.tenancy.keys import hash_api_key

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
MESHCTL = str(Path(sys.executable).parent / "meshctl")
BLOCK = re.compile(r"(?:<!-- docs-check: (\S+) (\S+) -->\n[ \t]*)?```(\w*)\n(.*?)^[ \t]*```",
                   re.S | re.M)
PLACEHOLDERS = {"<the hash>": hash_api_key("sk-docs-example")}


@dataclass
class Block:
    page: Path
    line: int
    text: str
    base: str | None = None  # docs-check: the shipped config
    path: str | None = None  # docs-check: where the fragment goes
    after: str = ""  # the page's text after the block, to the next heading

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line}"


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return "\n".join(l[indent:] for l in lines)


def yaml_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m.group(3) != "yaml":
                continue
            rest = text[m.end():]
            heading = re.search(r"^#", rest, re.M)
            blocks.append(Block(page, text[:m.start()].count("\n") + 1, _dedent(m.group(4)),
                                m.group(1), m.group(2),
                                rest[:heading.start()] if heading else rest))
    return blocks


def is_config(block: Block) -> bool:
    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError:
        return False
    return isinstance(data, dict) and "applications" in data


BLOCKS = yaml_blocks()
CONFIGS = [b for b in BLOCKS if is_config(b)]
RECIPES = [b for b in BLOCKS if b.base]


def test_the_rule_finds_the_docs_configs_and_recipes():
    """The two GPU variants of gpu-fleet.md and the add-a-tenant recipe, at least: a change
    of the block syntax must not leave the docs unchecked."""
    assert {b.page.name for b in CONFIGS} >= {"gpu-fleet.md"} and len(CONFIGS) >= 2
    assert any(b.page.name == "operating.md" and "id: newco" in b.text for b in RECIPES)


def validate(*paths: Path, engine: bool = True) -> subprocess.CompletedProcess:
    args = [MESHCTL, "validate", *map(str, paths)] + ([] if engine else ["--skip-engine-check"])
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def test_every_complete_config_passes_meshctl_validate(tmp_path):
    paths = []
    for i, block in enumerate(CONFIGS):
        paths.append(tmp_path / f"{i}.yaml")
        paths[-1].write_text(block.text)
    r = validate(*paths)
    names = {str(p): b.id for p, b in zip(paths, CONFIGS)}
    failed = [names[line.split(": INVALID")[0]] for line in r.stderr.splitlines()
              if ": INVALID" in line]
    assert r.returncode == 0, (failed, r.stderr)
    assert r.stdout.count(": ok") == len(CONFIGS), r.stdout


def _substituted(value: Any) -> Any:
    if isinstance(value, str):
        return PLACEHOLDERS.get(value, value)
    if isinstance(value, list):
        return [_substituted(v) for v in value]
    if isinstance(value, dict):
        return {k: _substituted(v) for k, v in value.items()}
    return value


def applied(block: Block) -> dict[str, Any]:
    """The block's base config with the fragment added at its path."""
    config = copy.deepcopy(load_yaml(REPO_ROOT / block.base))
    node: Any = config
    for part in block.path.split("."):
        m = re.fullmatch(r"(\w+)(?:\[([^\]]+)\])?", part)
        assert m, f"{block.id}: bad docs-check path part {part!r}"
        node = node[m.group(1)]
        if m.group(2):
            node = next(item for item in node if item.get("name") == m.group(2))
    fragment = _substituted(yaml.safe_load(block.text))
    if isinstance(node, list):
        node.extend(fragment if isinstance(fragment, list) else [fragment])
    else:
        node.update(fragment)
    return config


@pytest.mark.parametrize("block", RECIPES, ids=lambda b: b.id)
def test_every_recipe_passes_meshctl_validate_and_diff_says_what_it_shows(block, tmp_path):
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(applied(block), sort_keys=False))
    r = validate(new, engine=False)
    assert r.returncode == 0 and r.stdout.strip() == f"{new}: ok", r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    shown = re.search(r"```bash\n(.*?)```", block.after, re.S)
    diff = next((l for l in (shown.group(1) if shown else "").splitlines()
                 if "meshctl diff" in l), None)
    if diff is None:
        return
    r = subprocess.run([MESHCTL, "diff", str(REPO_ROOT / block.base), str(new),
                        "--skip-engine-check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    if claim := re.search(r"# one line: (\S+)", diff):
        changes = [l for l in r.stdout.splitlines() if l.startswith("  ")]
        assert len(changes) == 1 and claim.group(1) in changes[0], r.stdout
