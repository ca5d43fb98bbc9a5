"""Config files of real models, for tests that check engine args against a model without
its weights: what the hub serves for them at their pinned commits."""

from __future__ import annotations

import json
from pathlib import Path

#: meta-llama/Llama-3.1-8B-Instruct at this commit (the docs' and the fleet fixture's).
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_8B_COMMIT = "0e9e39f249a16976918f6564b8830bc894c89659"
#: Its config.json: 32 attention heads, 8 KV heads, a context of 131,072 tokens.
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
#: The ``total_size`` of its ``model.safetensors.index.json``: 8.03 billion bf16 parameters.
LLAMA_8B_WEIGHT_BYTES = 16_060_522_496


def write_llama_8b(folder: Path, *, weights_index: bool = False) -> Path:
    """A folder with Llama 3.1 8B's config files (and its safetensors index, no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
         "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    if weights_index:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": LLAMA_8B_WEIGHT_BYTES}, "weight_map": {}}))
    return folder
