"""A model's Hugging Face tokenizer (the one vLLM loads for it), for scripts that count or
replay a load's tokens without starting an engine."""

from __future__ import annotations


def hf_tokenizer(model: str):
    """The tokenizer of a config's ``model`` (a name under ``models/`` or a path).

    Raises:
        FileNotFoundError: no such model directory (the message says how to build it).
    """
    from transformers import AutoTokenizer

    from serve_app.common.paths import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model))
