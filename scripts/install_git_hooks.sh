#!/usr/bin/env bash
# Point git at the repository's hooks (scripts/git-hooks: commit-msg checks the commit
# convention of CONTRIBUTING.md), as ./scripts/setup.sh does. Idempotent; never fails the set-up.
#   ./scripts/install_git_hooks.sh
# Does nothing when git is not installed or this folder is not the top of a work tree git
# trusts (an unpacked archive, a container build without .git, a folder inside another
# repository). Leaves alone, with a note: a core.hooksPath set already (in any git config),
# and hooks of your own in .git/hooks, which core.hooksPath would turn off.
set -uo pipefail  # no -e: whatever git says, the set-up goes on
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
[ $# -eq 0 ] || { echo "install_git_hooks.sh: unknown argument '$1' (see --help)" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 0
HOOKS=scripts/git-hooks
note() { echo "[hooks] $*"; }
command -v git >/dev/null || exit 0
top=$(git rev-parse --show-toplevel 2>/dev/null) || exit 0
[ "$(cd "$top" && pwd -P)" = "$(pwd -P)" ] || exit 0
current=$(git config --get core.hooksPath 2>/dev/null)
if [ "$current" = "$HOOKS" ]; then
  exit 0
elif [ -n "$current" ]; then
  note "core.hooksPath is $current: left as it is (the commit convention's hook is $HOOKS/commit-msg)"
  exit 0
fi
own=()
hooks_dir=$(git rev-parse --git-path hooks 2>/dev/null) || hooks_dir=
for f in ${hooks_dir:+"$hooks_dir"/*}; do
  [ -f "$f" ] && [ -x "$f" ] && [ "${f%.sample}" = "$f" ] && own+=("${f##*/}")
done
if [ ${#own[@]} -gt 0 ]; then
  note "$hooks_dir has hooks of your own (${own[*]}): left as they are; to check the commit" \
    "convention too, run $HOOKS/commit-msg from your commit-msg hook"
elif git config --local core.hooksPath "$HOOKS" 2>/dev/null; then
  note "git uses $HOOKS: commit-msg checks each commit's subject line (CONTRIBUTING.md)"
else
  note "could not set core.hooksPath (git config --local core.hooksPath $HOOKS); skipped"
fi
exit 0
