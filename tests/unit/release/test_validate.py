"""``meshctl validate`` on sources that would climb out of the cache or carry credentials:
each config is refused, and no secret reaches its output (serve_app/release/validate.py)."""

from __future__ import annotations

import copy
import subprocess
import sys

import yaml

from serve_app.common.adapters import load_manifest
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml

SECRETS = ("wJalrSECRETKEY", "AKIAEXAMPLE", "SECRETSIGNATURE", "hf_SECRETTOKEN", "SECRETSIG")


def test_validate_refuses_every_climbing_uri_and_never_prints_a_credential(tmp_path):
    tenants = load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml")
    acme = load_manifest()["acme-support@v1"].model_dump()
    registry = tmp_path / "registry.yaml"
    registry.write_text(yaml.safe_dump({"adapters": [
        {**acme, "uri": "https://acme.s3.amazonaws.com/support?X-Amz-Credential=AKIAEXAMPLE"
                        "&X-Amz-Signature=SECRETSIGNATURE"},
        {**acme, "version": 2, "uri": "hf://hf_SECRETTOKEN@acme/support-lora",
         "revision": "0e9e39f249a16976918f6564b8830bc894c89659"},
        {**acme, "version": 3, "uri": "s3://AKIAEXAMPLE:wJalrSECRETKEY@acme/support"},
        {**acme, "version": 4, "uri": "gs://acme/support/../../../../home/ray/.ssh"}]}))

    def config(name: str, model: str | None = None, **user_config) -> str:
        cfg = copy.deepcopy(tenants)
        if model:
            cfg["applications"][1]["args"]["model"] = model
        cfg["applications"][1]["deployments"][0]["user_config"].update(user_config)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return str(path)

    versions = [{"name": "acme-support", "version": v} for v in (1, 2, 3, 4)]
    paths = [config("model-key", "s3://AKIAEXAMPLE:wJalrSECRETKEY@my-bucket/llama"),
             config("model-presigned", "https://b.s3.amazonaws.com/llama?X-Amz-Signature="
                                       "SECRETSIGNATURE&sig=SECRETSIG"),
             config("climb-s3", "s3://models/../../../../tmp/victim"),
             config("climb-gs", "gs://models/a/../../../etc"),
             config("climb-encoded", "s3://models/%2e%2e/%2e%2e/tmp/victim"),
             config("registry-key",
                    adapters_manifest="s3://AKIAEXAMPLE:wJalrSECRETKEY@acme/manifest.yaml"),
             config("registry-climb", adapters_manifest="s3://acme/../../../etc/manifest.yaml"),
             config("adapters", adapters_manifest=str(registry), adapters=versions)]
    res = subprocess.run([sys.executable, "-m", "serve_app.cli", "validate", *paths,
                          "--skip-engine-check"], capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "Traceback" not in out, out
    assert [line.split(": ")[0] for line in res.stderr.splitlines()
            if line.endswith(": INVALID")] == paths, out
    assert not [s for s in SECRETS if s in out], out
    assert out.count("a URI carries no credentials") == 4  # a model, a registry, 2 adapters
    adapter_lines = [line for line in res.stderr.splitlines()
                     if "[LLMReplica].user_config.adapters[" in line]
    assert len(adapter_lines) == 4 and all("***" in line for line in adapter_lines[:3])
    assert "'gs://acme/support/../../../../home/ray/.ssh': it has a path part '..'" in out
