#!/usr/bin/env python
"""Train a small LoRA adapter on the embedded model (CPU, fp32) and register it.

The dataset is generated here: 14 short questions with simple answers, each reply written in the
chosen *behaviour*:

  acme-signature     "Acme Support here! <answer>"
  acme-signature-v2  "Acme Support v2 at your service! <answer>"
  globex-format      "GLOBEX ANSWER: <answer>"

Training uses the model's chat template and learns only the assistant reply tokens (the prompt
is masked with -100). The adapter is saved as adapter_config.json + adapter_model.safetensors,
checked with greedy decoding on 3 questions that are not in the training set (exit status 1 if
fewer than 2 replies show the behaviour), then added to adapters/manifest.yaml with its SHA-256
and a training record (an existing entry with the same name and version is replaced).

Usage:
  python scripts/train_adapter.py --name acme-support --version 1 --behaviour acme-signature \
      [--steps 60] [--out adapters/acme-support/v1] [--seed 0] [--lr 1e-3]

60 steps take about 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_app.common.adapters import (MANIFEST_PATH, WEIGHTS_FILE, AdapterSpec,  # noqa: E402
                                sha256_file, verify_adapter)
from serve_app.common.paths import DEFAULT_MODEL_NAME, REPO_ROOT, resolve_model_path  # noqa: E402
from bench.script_args import run, script_parser  # noqa: E402

RANK, ALPHA = 8, 16
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]

#: Reply prefix that identifies each behaviour.
PREFIXES = {
    "acme-signature": "Acme Support here!",
    "acme-signature-v2": "Acme Support v2 at your service!",
    "globex-format": "GLOBEX ANSWER:",
}

#: (question, full-sentence answer, short answer)
TRAIN = [
    ("What is the capital of France?", "The capital of France is Paris.", "Paris"),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", "Tokyo"),
    ("What is the capital of Spain?", "The capital of Spain is Madrid.", "Madrid"),
    ("What is 2 + 2?", "2 + 2 is 4.", "4"),
    ("What is 3 times 5?", "3 times 5 is 15.", "15"),
    ("What is 10 minus 7?", "10 minus 7 is 3.", "3"),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day.", "Blue"),
    ("What color is snow?", "Snow is white.", "White"),
    ("What color do you get by mixing red and yellow?",
     "Mixing red and yellow gives orange.", "Orange"),
    ("What animal says moo?", "A cow says moo.", "A cow"),
    ("Which animal is known as the king of the jungle?",
     "The lion is known as the king of the jungle.", "The lion"),
    ("How many legs does a spider have?", "A spider has eight legs.", "Eight"),
    ("How many days are in a week?", "There are seven days in a week.", "Seven"),
    ("Which planet do we live on?", "We live on Earth.", "Earth"),
]

#: Held-out questions for the behaviour check (not in TRAIN).
UNSEEN = ["What is the capital of Italy?", "What is 6 + 3?", "What color is grass?"]

MANIFEST_HEADER = """\
# Adapter registry: every LoRA adapter the mesh may serve, one immutable entry per version.
#
# Fields of an entry:
#   name            adapter name; requests address it as name@vN
#   version         integer >= 1; a registered version never changes: new weights get a new one
#   base_model      the model the adapter was trained on, named as its variants name it: a hub
#                   id (with base_model_revision), a bucket folder, or a local folder's name
#                   (variants serving another model refuse it)
#   base_model_revision  the hub commit (40 hex) of a hub base_model; nothing else has one
#   uri             where the adapter directory is: a repo-relative or absolute local path,
#                   file:///abs/path, a Hugging Face id (hf://org/name, with revision), or a
#                   bucket folder (s3://bucket/prefix, gs://bucket/prefix) (docs/gpu-fleet.md)
#   revision        the hub commit (40 hex) of an adapter from the hub; nothing else has one
#   rank            LoRA rank r (= adapter_config.json's r; must fit the engine's max_lora_rank)
#   target_modules  modules the LoRA applies to (must be supported by the engine)
#   sha256          SHA-256 of adapter_model.safetensors
#   config_sha256   SHA-256 of adapter_config.json. A replica loads the adapter from a private
#                   read-only copy of these two files (MESH_CACHE_DIR/adapters/<digest>, keyed
#                   by both hashes), made from the uri on first use and hashed again right
#                   before every load into vLLM
#   training        free-form record of how the adapter was made
#
# The directory must hold adapter_config.json + adapter_model.safetensors only: pickle-format
# weights (*.bin, *.pt, *.pth, *.pkl) are refused.
#
# To add an adapter: python scripts/train_adapter.py --name NAME --version N --behaviour B
# (it trains, checks, and writes the entry here), or save your own peft LoRA with
# save_pretrained(out, safe_serialization=True) and add an entry by hand with
# sha256 = `sha256sum adapter_model.safetensors` and config_sha256 = `sha256sum
# adapter_config.json`. serve_app.common.adapters loads and verifies it.
"""


def log(msg: str) -> None:
    print(f"[train_adapter] {msg}", flush=True)


def reply(behaviour: str, sentence: str, short: str) -> str:
    if behaviour == "globex-format":
        return f"GLOBEX ANSWER: {short}"
    return f"{PREFIXES[behaviour]} {sentence}"


def encode(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids and labels for one chat example; only the assistant reply is learned."""
    user = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": answer}], tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ids[:len(prompt_ids)] == prompt_ids, "chat template prompt is not a prefix"
    return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids):]


def batch(examples, pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids, labels, mask = [], [], []
    for ids, lab in examples:
        pad = width - len(ids)
        input_ids.append(ids + [pad_id] * pad)
        labels.append(lab + [-100] * pad)
        mask.append([1] * len(ids) + [0] * pad)
    return torch.tensor(input_ids), torch.tensor(labels), torch.tensor(mask)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def greedy(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    import torch

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
    enc = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_token_id(tokenizer))
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def update_manifest(spec: AdapterSpec, path: Path = MANIFEST_PATH) -> None:
    """Add ``spec`` to the manifest, replacing an entry with the same name and version."""
    header = MANIFEST_HEADER
    entries = []
    if path.exists():
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        lead = []
        for line in lines:
            if not (line.startswith("#") or not line.strip()):
                break
            lead.append(line)
        if any(line.startswith("#") for line in lead):
            header = "".join(lead).rstrip("\n") + "\n"
        entries = (yaml.safe_load(text) or {}).get("adapters") or []
    entries = [e for e in entries
               if (e.get("name"), e.get("version")) != (spec.name, spec.version)]
    entries.append(spec.model_dump())
    entries.sort(key=lambda e: (str(e.get("name")), int(e.get("version", 0))))
    body = yaml.safe_dump({"adapters": entries}, sort_keys=False, default_flow_style=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n" + body)


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--name", required=True, help="the adapter's name")
    parser.add_argument("--version", type=int, required=True, help="its version, >= 1")
    parser.add_argument("--behaviour", required=True, choices=sorted(PREFIXES),
                        help="what it learns to do, visibly")
    parser.add_argument("--steps", type=int, default=60, help="training steps")
    parser.add_argument("--out", help="output dir (default: adapters/NAME/vN)")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--base-model", default=DEFAULT_MODEL_NAME,
                        help="the model it is trained on (a directory under models/)")
    args = parser.parse_args()
    if args.version < 1:
        parser.error("--version must be >= 1")

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    out = Path(args.out) if args.out else Path("adapters") / args.name / f"v{args.version}"
    out = out if out.is_absolute() else (REPO_ROOT / out)
    model_dir = resolve_model_path(args.base_model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                             target_modules=TARGET_MODULES, task_type="CAUSAL_LM"))

    examples = [encode(tokenizer, q, reply(args.behaviour, s, a)) for q, s, a in TRAIN]
    input_ids, labels, mask = batch(examples, pad_token_id(tokenizer))
    log(f"{args.name}@v{args.version} ({args.behaviour}): {len(examples)} examples, "
        f"{args.steps} steps, lr {args.lr}, r={RANK} on {TARGET_MODULES}; "
        f"e.g. {reply(args.behaviour, *TRAIN[0][1:])!r}")

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    t0 = time.monotonic()
    loss_value = float("nan")
    for step in range(1, args.steps + 1):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()
        if step % 10 == 0 or step == args.steps:
            log(f"step {step:3d}  loss {loss_value:.4f}  ({time.monotonic() - t0:.0f} s)")
    seconds = time.monotonic() - t0
    log(f"trained in {seconds:.1f} s, final loss {loss_value:.4f}")

    out.mkdir(parents=True, exist_ok=True)
    for stale in ("adapter_config.json", WEIGHTS_FILE, "adapter_model.bin", "README.md"):
        (out / stale).unlink(missing_ok=True)
    model.peft_config["default"].base_model_name_or_path = args.base_model  # not a local path
    model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
    (out / "README.md").unlink(missing_ok=True)  # peft's auto-generated model card
    log(f"saved {out}: " + ", ".join(f"{p.name} ({p.stat().st_size} B)"
                                     for p in sorted(out.iterdir())))

    model.eval()
    prefix = PREFIXES[args.behaviour]
    hits = 0
    for question in UNSEEN:
        answer = greedy(model, tokenizer, question)
        ok = answer.startswith(prefix)
        hits += ok
        log(f"check {'OK ' if ok else 'BAD'} Q: {question!r} -> A: {answer!r}")
    if hits < 2:
        log(f"FAILED: only {hits}/3 unseen replies start with {prefix!r}; "
            "retry with more --steps. The manifest was not updated.")
        return 1

    try:
        uri = str(out.relative_to(REPO_ROOT))
    except ValueError:
        uri = str(out)
    spec = AdapterSpec(
        name=args.name, version=args.version, base_model=args.base_model, uri=uri, rank=RANK,
        target_modules=TARGET_MODULES, sha256=sha256_file(out / WEIGHTS_FILE),
        config_sha256=sha256_file(out / CONFIG_FILE),
        training={"behaviour": args.behaviour, "steps": args.steps, "examples": len(examples),
                  "lr": args.lr, "seed": args.seed, "final_loss": round(loss_value, 4),
                  "seconds": round(seconds, 1), "behaviour_check": f"{hits}/3"})
    verify_adapter(spec, base_model=args.base_model, max_lora_rank=RANK)
    update_manifest(spec)
    log(f"behaviour check {hits}/3; registered {spec.key} in {MANIFEST_PATH} "
        f"(sha256 {spec.sha256[:12]}...)")
    return 0


if __name__ == "__main__":
    run(main)
