"""The commit convention's hook (scripts/git-hooks/commit-msg) on good and bad messages, and its
installer (scripts/install_git_hooks.sh, run by setup.sh) in a fresh repository, a folder
without .git, a repository inside another one, and beside a user's own hooks. Real git, no
network."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.common.paths import REPO_ROOT

HOOK = REPO_ROOT / "scripts" / "git-hooks" / "commit-msg"
INSTALL = REPO_ROOT / "scripts" / "install_git_hooks.sh"
#: No GIT_DIR or GIT_INDEX_FILE of a git command that runs these tests: each git here is its own.
GIT_ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
BODY = "\n\nWhy it was needed, and the figures: 3 of 4 passed before, 4 of 4 now.\n"


def hook(message: str, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    return subprocess.run([sys.executable, str(HOOK), str(path)], capture_output=True,
                          text=True, timeout=30, cwd=tmp_path, env=GIT_ENV)


@pytest.mark.parametrize("message", [
    "Refuse budgets that cannot hold one request" + BODY,
    "x" * 72 + BODY,  # at the limit
    "Fix a typo in the README\n",  # a subject alone
    "\n\nSay what a request reserves" + BODY,  # git drops leading blank lines
    "# Please enter the commit message\n" + "# " + "y" * 100 + "\nShort subject" + BODY,
    "Short subject" + BODY + "# ------------------------ >8 ------------------------\n"
    + "+" + "z" * 200 + "\n",  # git commit -v: the diff below the scissors is not kept
    "é" * 72 + BODY,  # characters, not bytes
    "Merge branch 'feature/a-very-long-branch-name-that-goes-on' of github.com:org/repo into"
    " main\n",  # git's own subject
    'Revert "Count busy tenants on budget leases instead of a ledger call each"' + BODY,
])
def test_a_message_that_keeps_the_convention_passes(message, tmp_path):
    r = hook(message, tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("message, why", [
    ("x" * 73 + BODY, "the subject line is 73 characters; keep it to 72"),
    ("Move the reservation to one place; generate it from the code; make validate size "
     "budgets from max_model_len; 819 passed\n", "the subject line is 119 characters"),
    ("Short subject\nA body with no blank line above it\n", "the second line is not blank"),
    ("Short subject\n# a comment git strips\nA body\n", "the second line is not blank"),
    ("Merge the two ledgers' lease paths into one so renewals and settlements share a call"
     + BODY, "the subject line is 84 characters"),  # a subject of ours, not git's merge
])
def test_a_message_that_breaks_it_is_refused_with_the_reason(message, why, tmp_path):
    r = hook(message, tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith(f"commit-msg: {why}"), r.stderr
    assert f"git commit -e -F {tmp_path / 'COMMIT_EDITMSG'}" in r.stderr


def git(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=GIT_ENV)


def checkout(root) -> None:
    """The installer and the hook, where a clone would have them."""
    (root / "scripts" / "git-hooks").mkdir(parents=True)
    shutil.copy2(INSTALL, root / "scripts" / INSTALL.name)
    shutil.copy2(HOOK, root / "scripts" / "git-hooks" / HOOK.name)


def install(root) -> subprocess.CompletedProcess:
    return subprocess.run([str(root / "scripts" / INSTALL.name)], capture_output=True,
                          text=True, timeout=60, env=GIT_ENV)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_setup_installs_the_hook_and_git_runs_it(tmp_path):
    git("init", "-q", str(tmp_path), cwd=tmp_path)
    checkout(tmp_path)
    r = install(tmp_path)
    assert r.returncode == 0 and "commit-msg checks" in r.stdout, r.stderr
    assert git("config", "core.hooksPath", cwd=tmp_path).stdout.strip() == "scripts/git-hooks"
    assert install(tmp_path).stdout == ""  # idempotent, and quiet when done
    git("add", "scripts", cwd=tmp_path)
    refused = git("commit", "-q", "-m", "x" * 80, "-m", "Why: to test.", cwd=tmp_path)
    assert refused.returncode == 1 and "the subject line is 80 characters" in refused.stderr
    assert git("rev-list", "--all", cwd=tmp_path).stdout == ""  # nothing committed
    # The command the hook prints commits the kept message once its subject is shortened.
    again = shlex.split(refused.stderr.splitlines()[-1])
    assert again[:4] == ["git", "commit", "-e", "-F"], refused.stderr
    kept = subprocess.run(again, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**GIT_ENV, "GIT_EDITOR": "sed -i 1s/.*/Add\\ the\\ hook/"})
    assert kept.returncode == 0, kept.stderr
    assert git("log", "--format=%B", cwd=tmp_path).stdout == "Add the hook\n\nWhy: to test.\n\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_installer_leaves_what_is_not_its_own(tmp_path):
    """No .git (an unpacked archive): nothing to do. Inside another repository's work tree:
    that repository's config is not ours. A hooksPath of the user's own: left, with a note."""
    plain = tmp_path / "plain"
    checkout(plain)
    r = install(plain)
    assert r.returncode == 0 and r.stdout == "" and not (plain / ".git").exists()

    outer = tmp_path / "outer"
    git("init", "-q", str(outer), cwd=tmp_path)
    checkout(outer / "vendored")
    assert install(outer / "vendored").returncode == 0
    assert git("config", "core.hooksPath", cwd=outer).stdout == ""

    own = tmp_path / "own"
    git("init", "-q", str(own), cwd=tmp_path)
    checkout(own)
    git("config", "core.hooksPath", ".githooks", cwd=own)
    r = install(own)
    assert r.returncode == 0 and "left as it is" in r.stdout
    assert git("config", "core.hooksPath", cwd=own).stdout.strip() == ".githooks"

    # Hooks of one's own in .git/hooks, which core.hooksPath would silently turn off.
    mine = tmp_path / "mine"
    git("init", "-q", str(mine), cwd=tmp_path)
    checkout(mine)
    (mine / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
    (mine / ".git" / "hooks" / "pre-commit").chmod(0o755)
    r = install(mine)
    assert r.returncode == 0 and "hooks of your own (pre-commit)" in r.stdout, r.stdout
    assert git("config", "core.hooksPath", cwd=mine).returncode == 1  # unset


def test_the_installer_is_shellcheck_clean():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    r = subprocess.run([str(shellcheck), str(INSTALL)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout
