"""Adapter registry and verification, on the shipped adapters (no Ray, no vLLM)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from serve_app.common.adapters import (MANIFEST_PATH, AdapterError, AdapterSpec,
                                       base_model_problem, fit_problem, load_manifest,
                                       manifest_file, resolve_uri, sha256_file, verify_adapter)
from serve_app.common.paths import REPO_ROOT, models_dir

BASE = "smollm2-135m-instruct"
SHIPPED = {"acme-support@v1", "acme-support@v2", "globex-report@v1"}


@pytest.fixture(scope="module")
def manifest() -> dict[str, AdapterSpec]:
    return load_manifest()


@pytest.fixture
def acme(manifest) -> AdapterSpec:
    return manifest["acme-support@v1"]


@pytest.fixture
def acme_copy(acme, tmp_path) -> AdapterSpec:
    """The acme-support@v1 spec pointing at a private copy of its directory."""
    copy = tmp_path / "acme"
    shutil.copytree(resolve_uri(acme.uri), copy)
    return acme.model_copy(update={"uri": str(copy)})


def test_manifest_lists_shipped_adapters(manifest):
    assert SHIPPED <= set(manifest)
    for key, spec in manifest.items():
        assert key == f"{spec.name}@v{spec.version}"
        assert not Path(spec.uri).is_absolute(), "shipped uris are repo-relative"


def test_every_shipped_adapter_verifies(manifest):
    for spec in manifest.values():
        path = verify_adapter(spec, base_model=BASE, max_lora_rank=16)
        assert path == REPO_ROOT / spec.uri
        assert sorted(p.name for p in path.iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors"]
        assert sha256_file(path / "adapter_model.safetensors") == spec.sha256
        assert spec.training["steps"] >= 1 and "final_loss" in spec.training


def test_copy_verifies_at_new_location(acme_copy):
    assert verify_adapter(acme_copy, base_model=BASE, max_lora_rank=8) == Path(acme_copy.uri)
    file_uri = acme_copy.model_copy(update={"uri": f"file://{acme_copy.uri}"})
    assert verify_adapter(file_uri, base_model=BASE, max_lora_rank=8) == Path(acme_copy.uri)


def test_tampered_weights_refused(acme_copy):
    weights = Path(acme_copy.uri) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterError) as e:
        verify_adapter(acme_copy, base_model=BASE, max_lora_rank=8)
    msg = str(e.value)
    assert "acme-support@v1" in msg and "SHA-256 mismatch" in msg
    assert acme_copy.sha256[:12] in msg and sha256_file(weights)[:12] in msg


def test_pickle_weights_refused(acme_copy):
    (Path(acme_copy.uri) / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(AdapterError, match="pickled weights can run code") as e:
        verify_adapter(acme_copy, base_model=BASE, max_lora_rank=8)
    assert "adapter_model.bin" in str(e.value)
    assert "safe_serialization=True" in str(e.value)


def test_wrong_base_model_refused(acme):
    with pytest.raises(AdapterError) as e:
        verify_adapter(acme, base_model="/srv/models/other-model", max_lora_rank=8)
    assert (f"trained for {BASE!r}, but this variant serves 'other-model' "
            "(/srv/models/other-model)") in str(e.value)


def test_a_base_model_named_by_its_path_is_the_same_model(acme):
    """Images and KubeRay pods name models by absolute path: the adapter still fits."""
    for named in (str(models_dir() / BASE), f"{models_dir() / BASE}/", f"./models/{BASE}",
                  f"file://{models_dir() / BASE}"):
        assert fit_problem(acme, base_model=named, max_lora_rank=8) is None, named
    verify_adapter(acme, base_model=str(models_dir() / BASE), max_lora_rank=8)


def test_rank_over_max_refused(acme):
    with pytest.raises(AdapterError, match=r"rank 8 is over this variant's max_lora_rank=4"):
        verify_adapter(acme, base_model=BASE, max_lora_rank=4)


def test_rank_mismatch_with_config_refused(acme):
    wrong = acme.model_copy(update={"rank": 16})
    with pytest.raises(AdapterError, match=r"has r=8 but the manifest says rank=16"):
        verify_adapter(wrong, base_model=BASE, max_lora_rank=64)


def test_unsupported_target_modules_refused(acme):
    with pytest.raises(AdapterError, match=r"target modules \['k_proj', 'o_proj'\] are not"):
        verify_adapter(acme, base_model=BASE, max_lora_rank=8,
                       supported_modules=frozenset({"q_proj", "v_proj"}))


def test_missing_dir_refused(acme, tmp_path):
    gone = acme.model_copy(update={"uri": str(tmp_path / "nowhere")})
    with pytest.raises(AdapterError, match=r"adapter acme-support@v1: directory .*nowhere.* "
                                           r"does not exist"):
        verify_adapter(gone, base_model=BASE, max_lora_rank=8)


@pytest.mark.parametrize("uri", ["s3://bucket/acme/v1", "gs://bucket/acme/v1"])
def test_remote_uri_is_fetched_not_read_in_place(acme, uri):
    """A bucket uri is no local folder; verify_adapter checks what it can offline (the
    source's shape, the fit) and leaves the files to the private copy's checks."""
    with pytest.raises(AdapterError, match="is remote: it is fetched into the node's cache"):
        resolve_uri(uri)
    remote = acme.model_copy(update={"uri": uri})
    assert verify_adapter(remote, base_model=BASE, max_lora_rank=8) is None
    with pytest.raises(AdapterError, match="rank 8 is over"):
        verify_adapter(remote, base_model=BASE, max_lora_rank=4)


@pytest.mark.parametrize("uri, revision, match", [
    ("ftp://host/acme", None, "scheme 'ftp://' is not supported"),
    ("s3://B/acme", None, "'B' is not a bucket name"),
    ("hf://org/acme", None, "no revision: pin the commit"),
    ("hf://org/acme", "main", "revision 'main' is not pinned"),
    ("adapters/acme-support/v1", "a" * 40, "is not a Hugging Face model id"),
])
def test_bad_sources_refused(acme, uri, revision, match):
    bad = acme.model_copy(update={"uri": uri, "revision": revision})
    with pytest.raises(AdapterError, match=match):
        verify_adapter(bad, base_model=BASE, max_lora_rank=8)


def test_duplicate_manifest_entries_refused(acme, tmp_path):
    entry = acme.model_dump()
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump({"adapters": [entry, dict(entry, uri="elsewhere")]}))
    with pytest.raises(AdapterError, match=r"adapters\[1\] duplicates acme-support@v1 "
                                           r"\(first at adapters\[0\]\)"):
        load_manifest(path)


def test_schema_error_names_entry_and_field(acme, tmp_path):
    path = tmp_path / "manifest.yaml"
    bad = dict(acme.model_dump(), version=0)
    path.write_text(yaml.safe_dump({"adapters": [acme.model_dump(), bad]}))
    with pytest.raises(AdapterError, match=r"adapters\[1\] is invalid: field 'version'"):
        load_manifest(path)
    path.write_text(yaml.safe_dump({"adapters": [dict(acme.model_dump(), colour="red")]}))
    with pytest.raises(AdapterError, match=r"adapters\[0\] is invalid: field 'colour'"):
        load_manifest(path)


COMMIT = "0e9e39f249a16976918f6564b8830bc894c89659"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("base_model, base_revision, variant_model, variant_revision, problem", [
    (LLAMA, COMMIT, LLAMA, COMMIT, None),
    (LLAMA, COMMIT, f"hf://{LLAMA}", COMMIT, None),
    (LLAMA, COMMIT, "other-org/Llama-3.1-8B-Instruct", COMMIT,
     f"trained for 'hf://{LLAMA}@{COMMIT}', but this variant serves "
     f"'hf://other-org/Llama-3.1-8B-Instruct@{COMMIT}' (other-org/Llama-3.1-8B-Instruct); "
     f"declare it on a variant of 'hf://{LLAMA}@{COMMIT}'"),
    (LLAMA, COMMIT, LLAMA, "f" * 40, f"but this variant serves 'hf://{LLAMA}@{'f' * 40}'"),
    (LLAMA, COMMIT, "s3://models/Llama-3.1-8B-Instruct", None,
     "but this variant serves 's3://models/Llama-3.1-8B-Instruct'"),
    ("Llama-3.1-8B-Instruct", None, "s3://models/Llama-3.1-8B-Instruct", None,
     "trained for 'Llama-3.1-8B-Instruct', but this variant serves "
     "'s3://models/Llama-3.1-8B-Instruct'"),
    ("s3://models/llama/", None, "s3://models/llama", None, None),
    ("s3://models/llama", None, "gs://models/llama", None, "serves 'gs://models/llama'"),
    ("Llama-3.1-8B-Instruct", None, "/srv/models/Llama-3.1-8B-Instruct/", None, None),
    (LLAMA, None, LLAMA, COMMIT,
     f"its base_model '{LLAMA}' is a Hugging Face id with no revision: pin the commit every "
     "replica downloads with `base_model_revision: <40-hex commit hash>`"),
    ("Llama-3.1-8B-Instruct", COMMIT, "Llama-3.1-8B-Instruct", None,
     "'Llama-3.1-8B-Instruct' is a local source: 'base_model_revision' pins a Hugging Face id "
     "only; remove it"),
])
def test_an_adapter_fits_only_its_base_model(acme, base_model, base_revision, variant_model,
                                             variant_revision, problem):
    """The issue: matched by the last path part, other-org/<same name>, at any revision,
    counted as the same model."""
    spec = acme.model_copy(update={"base_model": base_model,
                                   "base_model_revision": base_revision})
    found = base_model_problem(spec, base_model=variant_model, base_revision=variant_revision)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found
        assert fit_problem(spec, base_model=variant_model, max_lora_rank=16,
                           base_revision=variant_revision) == found


def test_the_registry_file_a_variant_names(tmp_path, monkeypatch):
    assert manifest_file(None) == MANIFEST_PATH
    assert manifest_file("/srv/registry/manifest.yaml") == Path("/srv/registry/manifest.yaml")
    assert manifest_file("file:///srv/registry/m.yaml") == Path("/srv/registry/m.yaml")
    # relative: from the config's folder where meshctl knows it, else the repository root
    assert manifest_file("registry/m.yaml", config_dir=tmp_path) == tmp_path / "registry/m.yaml"
    assert manifest_file("registry/m.yaml") == REPO_ROOT / "registry" / "m.yaml"
    with pytest.raises(AdapterError, match=r"^adapter registry 's3://acme/\.\./\.\./m\.yaml': "
                                           r"it has a path part '\.\.'"):
        manifest_file("s3://acme/../../m.yaml")
    with pytest.raises(AdapterError) as refusal:
        manifest_file("s3://AKIAEXAMPLE:wJalrSECRETKEY@acme/m.yaml")
    assert "wJalrSECRETKEY" not in str(refusal.value) and "s3://***@acme" in str(refusal.value)
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing answers
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_SKIP_SIGNATURE", "true")
    with pytest.raises(AdapterError, match=r"^adapter registry: could not read "
                                           r"s3://acme-registry/m\.yaml: "):
        manifest_file("s3://acme-registry/m.yaml")


def test_an_adapter_error_carries_no_credential():
    e = AdapterError("adapter a@v1: could not fetch hf://hf_TOKEN99@org/x: 401 "
                     "https://cdn/x?X-Amz-Signature=SIG99")
    assert "TOKEN99" not in str(e) and "SIG99" not in str(e) and "adapter a@v1" in str(e)
