"""The simulated engine answers a merged model's own weights as the LoRA path answers the
adapter merged in, only when the merge used that adapter version's registered weights."""

from __future__ import annotations

import json

from serve_app.common.adapters import MODEL_STAMP, load_manifest
from serve_app.common.paths import REPO_ROOT
from serve_app.sim.core import merged_label


def merged_model(tmp_path, adapter_sha256: str):
    model = tmp_path / "merged"
    model.mkdir()
    (model / "config.json").write_text("{}")  # what makes a folder a model here
    (model / MODEL_STAMP).write_text(json.dumps({
        "source": "smollm2-135m-instruct + acme-support@v1 (peft merge_and_unload)",
        "adapter_sha256": adapter_sha256}))
    return str(model)


def test_a_merge_of_the_registered_weights_answers_as_the_lora_path():
    assert merged_label(str(REPO_ROOT / "models" / "smollm2-135m-acme")) == "acme-support@v1"


def test_a_merge_of_other_weights_answers_otherwise(tmp_path):
    registered = load_manifest()["acme-support@v1"].sha256
    assert merged_label(merged_model(tmp_path, registered)) == "acme-support@v1"
    other = load_manifest()["acme-support@v2"].sha256
    (tmp_path / "merged").rename(tmp_path / "was")
    assert merged_label(merged_model(tmp_path, other)) == f"acme-support@v1#{other[:12]}"


def test_a_model_with_nothing_merged_in_has_no_merged_label(tmp_path):
    assert merged_label(str(tmp_path)) is None
