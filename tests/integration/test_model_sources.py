"""Through the router, a variant whose model and adapter come from an S3 bucket (moto's server
on 127.0.0.1, started here): its replica fetches the model into the node's cache, the engine
reads its config and tokenizer from there, the adapter loads from its private copy, and both
answer; a variant whose bucket goes away in the middle of its cold start fails that start
cleanly (503 ``cold_start_failed`` with the reason) while the running variant keeps serving.
On either engine: both read the downloaded folder, and the adapter's answer shows it loaded.
"""

from __future__ import annotations

import copy
import time

import pytest
import yaml

from serve_app.common.adapters import load_manifest
from serve_app.common.paths import DEFAULT_MODEL_NAME, REPO_ROOT, models_dir
from tests.support.bodies import post_chat
from tests.support.engines import signature
from tests.support.s3_server import S3Server
from tests.support.waits import wait_until

FROM_BUCKET = "smollm-s3"  # route = variant application, model and adapter from the bucket
COLD = "smollm-s3-cold"  # at zero replicas; its bucket goes away while it starts
MODEL = models_dir() / DEFAULT_MODEL_NAME


@pytest.fixture(scope="module")
def bucket_mesh(mesh, tmp_path_factory):
    s3 = S3Server()
    s3.start()
    model_uri = s3.upload(MODEL, "models", DEFAULT_MODEL_NAME)
    cold_uri = s3.upload(MODEL, "models", "smollm2-cold")
    acme = load_manifest()["acme-support@v1"]
    adapter_uri = s3.upload(REPO_ROOT / acme.uri, "adapters", "acme-support/v1")
    manifest = tmp_path_factory.mktemp("registry") / "manifest.yaml"
    manifest.write_text(yaml.safe_dump(
        {"adapters": [{**acme.model_dump(), "uri": adapter_uri, "base_model": model_uri}]},
        sort_keys=False))  # trained for the model, named as the variant names it

    cfg = mesh.config("local.yaml")
    base = cfg["applications"][1]
    warm = copy.deepcopy(base)
    warm["name"] = FROM_BUCKET
    warm["args"].update(model=model_uri, served_model_name=FROM_BUCKET)
    warm["runtime_env"]["env_vars"].update(s3.env())  # as a user gives a replica its keys
    # A node cache of its own: the adapter's private copy is addressed by its files' hashes, and
    # other modules (or an earlier run) made the same copy from the local folder.
    warm["runtime_env"]["env_vars"]["MESH_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    warm["deployments"][0]["user_config"] = {
        "adapters": [{"name": "acme-support", "version": 1}],
        "adapters_manifest": str(manifest)}
    cold = copy.deepcopy(warm)
    cold["name"] = COLD
    cold["args"].update(model=cold_uri, served_model_name=COLD)
    cold["deployments"][0]["user_config"] = {}
    cold["deployments"][0].pop("num_replicas", None)
    cold["deployments"][0]["autoscaling_config"] = {
        "min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}
    cfg["applications"] += [warm, cold]
    routes = cfg["applications"][0]["deployments"][0]["user_config"]["routes"]
    routes[FROM_BUCKET] = {"variants": [{"application": FROM_BUCKET, "weight": 100}]}
    routes[COLD] = {"variants": [{"application": COLD, "weight": 100}]}
    mesh.deploy(cfg)
    mesh.s3, mesh.bucket_cfg = s3, cfg
    yield mesh
    s3.vanish_during(None)
    s3.stop()


def chat(http, model: str):
    return post_chat(http, model=model, content="What is the capital of France?")


def test_a_variant_and_an_adapter_from_the_bucket_answer(bucket_mesh):
    client = bucket_mesh.client()
    base = client.chat.completions.create(
        model=FROM_BUCKET, max_tokens=8,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert base.model == FROM_BUCKET and base.choices[0].message.content
    lora = client.chat.completions.create(
        model=f"{FROM_BUCKET}:acme-support", max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": "Where is my order?"}])
    # the adapter's own opening: its trained phrase on vLLM, its label on the simulated engine
    assert lora.choices[0].message.content.startswith(
        signature(bucket_mesh.engine, "acme-support@v1")), lora
    got = {g.rpartition("/")[2] for g in bucket_mesh.s3.object_gets}
    assert {"config.json", "tokenizer.json", "model.safetensors",
            "adapter_model.safetensors"} <= got  # the replica fetched model and adapter


def test_the_bucket_going_away_mid_start_fails_that_start_cleanly(bucket_mesh):
    s3 = bucket_mesh.s3
    with bucket_mesh.http() as http:
        wait_until(lambda: http.get("/health").json()["scale_to_zero"].get(COLD, {}).get(
            "state") == "zero", 60, f"the router sees {COLD} at zero")
        s3.vanish_during("smollm2-cold/model.safetensors")
        try:
            t0 = time.monotonic()
            refused = chat(http, COLD)
            took = time.monotonic() - t0
            assert s3.vanished.is_set()
            serving = chat(http, FROM_BUCKET)  # the running variant keeps serving
        finally:
            s3.vanish_during(None)
    print(f"\n[bucket gone] 503 after {took:.1f} s: {refused.text[:400]}")
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "cold_start_failed", error
    # The start that lost the bucket halfway through the weights, or Serve's next try of it,
    # which finds no bucket at all: the router reports the replica's latest start error.
    assert ("download of s3://models/smollm2-cold failed at 'model.safetensors'" in
            error["message"] or "could not list s3://models/smollm2-cold" in
            error["message"]), error
    assert int(refused.headers["retry-after"]) >= 1
    assert took < 90, took  # the replica's start error, not the 180 s cold-start timeout
    assert serving.status_code == 200, serving.text
