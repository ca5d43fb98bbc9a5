#!/usr/bin/env bash
# Install a lock file into a Python environment: every package of requirements-$MESH_ACCEL.txt
# at its pinned version, checked against the lock's hashes, without dependencies (the lock
# holds them all); then each PACKAGE named (also --no-deps); then this package, editable and
# --no-deps. The one install both scripts/setup.sh (into .venv) and deploy/kuberay/Dockerfile
# (into the image's Python) run, so the image holds what the tests test.
#   With uv (UV: the path of a uv binary): `uv pip sync --require-hashes`, which also removes
#   what the lock does not name; if uv fails, pip.
#   With pip (UV empty or unset): `pip install --require-hashes --no-deps -r LOCK`, which only
#   adds (an image keeps its base's other packages); on CPU it then removes torchvision,
#   torchaudio and torchcodec, which the CPU lock leaves out (beside the CPU torch they break
#   transformers' model classes).
# torch on CPU (torch==2.13.0+cpu is not on PyPI): from TORCH_FIND_LINKS when its wheel is
# there, else from PyTorch's CPU index TORCH_INDEX_URL. The GPU lock comes from PyPI alone.
# Usage: scripts/install_lock.sh [--print] PYTHON [PACKAGE...]
#   --print   print the commands, one a line, and run none
# Environment [default]: MESH_ACCEL [cpu] (or gpu); UV [empty: pip];
# TORCH_INDEX_URL [https://download.pytorch.org/whl/cpu]; TORCH_FIND_LINKS [/opt/wheels].
# scripts/setup.sh sources this file for torch_source and install_lock.
set -euo pipefail

TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}

# torch_source uv|pip: where torch==2.13.0+cpu comes from, as that installer's options.
torch_source() {
  if compgen -G "$TORCH_FIND_LINKS/torch-2.13.0+cpu-*.whl" >/dev/null; then
    echo --find-links "$TORCH_FIND_LINKS"
  elif [ "$1" = uv ]; then
    echo --index "$TORCH_INDEX_URL" --index-strategy unsafe-best-match
  else
    echo --extra-index-url "$TORCH_INDEX_URL"
  fi
}

# install_lock PYTHON [PACKAGE...]: the install (see the top of this file); PRINT=1 prints it.
install_lock() {
  local py=$1 accel=${MESH_ACCEL:-cpu} src=() uv=${UV:-}
  shift
  case "$accel" in cpu|gpu) ;; *) echo "MESH_ACCEL must be cpu or gpu, not '$accel'" >&2; return 2;; esac
  local lock=requirements-$accel.txt
  if [ -n "$uv" ]; then
    # shellcheck disable=SC2207
    [ "$accel" = cpu ] && src=($(torch_source uv))
    # --compile-bytecode: uv writes no .pyc by default, and with PYTHONDONTWRITEBYTECODE set
    # Python never caches one either, so every replica, engine and `serve deploy` build would
    # compile vLLM, torch and Ray from source (`import vllm` 32 s without, 15 s with, here).
    if _run "$uv" pip sync --python "$py" --compile-bytecode --require-hashes "${src[@]}" "$lock" \
        && { [ $# = 0 ] || _run "$uv" pip install --python "$py" --no-deps "$@"; } \
        && _run "$uv" pip install --python "$py" --no-deps --no-build-isolation -e .; then
      return 0
    fi
    echo "install_lock.sh: uv could not install $lock; trying pip" >&2
    src=()
  fi
  # shellcheck disable=SC2207
  [ "$accel" = cpu ] && src=($(torch_source pip))
  _run "$py" -m pip install -q --require-hashes --no-deps "${src[@]}" -r "$lock"
  if [ "$accel" = cpu ]; then
    _run "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  [ $# = 0 ] || _run "$py" -m pip install -q --no-deps "$@"
  _run "$py" -m pip install -q --no-deps --no-build-isolation -e .
}

# _run CMD...: run it, or with PRINT=1 print it (words quoted as the shell would take them).
_run() {
  if [ "${PRINT:-0}" = 1 ]; then
    local out
    printf -v out '%q ' "$@"
    echo "${out% }"
    return 0
  fi
  "$@"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
  PRINT=0
  if [ "${1:-}" = --print ]; then PRINT=1; shift; fi
  case "${1:-}" in
    ""|-*) echo "install_lock.sh: usage: scripts/install_lock.sh [--print] PYTHON [PACKAGE...] (see --help)" >&2; exit 2;;
  esac
  cd "$(dirname "$0")/.."
  install_lock "$@"
fi
