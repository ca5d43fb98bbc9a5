"""The bytes of weights a variant's engine reads (:mod:`serve_app.common.model_weights`):
from the model's files when they are here, else its name, else its config.json."""

from __future__ import annotations

import math

import pytest

from serve_app.common.config import VariantArgs
from serve_app.common.model_weights import (NAME_MARGIN, parameters_in_config,
                                            parameters_in_name, weight_bytes)
from serve_app.common.paths import models_dir
from tests.support.model_configs import (LLAMA_8B, LLAMA_8B_COMMIT, LLAMA_8B_WEIGHT_BYTES,
                                         write_llama_8b)


def args(model: str, revision: str | None = None, **engine) -> VariantArgs:
    return VariantArgs.model_validate({"model": model, "revision": revision,
                                       "served_model_name": "m", "engine_args": engine})


@pytest.mark.parametrize("name, count", [
    ("meta-llama/Llama-3.1-8B-Instruct", 8e9), ("s3://models/Llama-3.3-70B-Instruct", 70e9),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", 56e9), ("Qwen/Qwen3-30B-A3B", 30e9),
    ("Qwen/Qwen2.5-1.5B-Instruct", 1.5e9), ("HuggingFaceTB/SmolLM2-135M-Instruct", 135e6),
    ("mistralai/Mistral-Nemo-Instruct-2407", 0), ("gpt2", 0)])
def test_the_parameter_count_a_name_states(name, count):
    assert parameters_in_name(name) == count


def test_llama_8b_from_its_config_json_is_its_real_count(tmp_path):
    folder = write_llama_8b(tmp_path / "m")
    assert parameters_in_config(folder / "config.json") * 2 == LLAMA_8B_WEIGHT_BYTES


def test_the_embedded_models_folder_gives_its_files():
    found = weight_bytes(args("smollm2-135m-instruct"))
    weights = models_dir() / "smollm2-135m-instruct" / "model.safetensors"
    assert found.bytes == weights.stat().st_size and "*.safetensors files" in found.how


def test_a_hub_model_not_here_is_sized_from_its_name_per_dtype():
    found = weight_bytes(args(LLAMA_8B, LLAMA_8B_COMMIT, dtype="bfloat16"))
    assert found.bytes == math.ceil(8e9 * (1 + NAME_MARGIN) * 2) >= LLAMA_8B_WEIGHT_BYTES
    assert weight_bytes(args(LLAMA_8B, LLAMA_8B_COMMIT, dtype="float32")).bytes == \
        2 * found.bytes
    assert weight_bytes(args(LLAMA_8B, LLAMA_8B_COMMIT, quantization="fp8")).bytes == \
        found.bytes // 2


def test_a_cached_copy_gives_its_safetensors_index(tmp_path, monkeypatch):
    """A hub model fetched on this host: its index's total_size, unless cached=False."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = (tmp_path / "hf" / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" /
                "snapshots" / LLAMA_8B_COMMIT)
    write_llama_8b(snapshot, weights_index=True)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    found = weight_bytes(args(LLAMA_8B, LLAMA_8B_COMMIT))
    assert found.bytes == LLAMA_8B_WEIGHT_BYTES and "safetensors index" in found.how
    assert weight_bytes(args(LLAMA_8B, LLAMA_8B_COMMIT), cached=False).how.startswith(
        "the name")


def test_nothing_tells_a_size():
    found = weight_bytes(args("s3://models/mistral-nemo-instruct"))
    assert found.bytes == 0 and "no parameter count such as 8B in its name" in found.how
