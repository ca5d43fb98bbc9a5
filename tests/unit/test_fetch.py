"""Models and adapters fetched from a bucket and from the hub, over the real protocols: moto's
S3 server and a local hub for the real ``huggingface_hub`` client, both on 127.0.0.1
(tests/support). Fetched once per node into the cache; a partial download is a clean failure;
an adapter is loaded from a private copy hashed again right before every load."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from serve_app.common import adapter_cache
from serve_app.common.adapters import WEIGHTS_FILE, load_manifest, sha256_file
from serve_app.common.errors import MeshError
from serve_app.common.fetch import FetchError, bucket_cache_dir, cached_model, fetch_model
from serve_app.common.paths import DEFAULT_MODEL_NAME, REPO_ROOT, models_dir
from serve_app.common.sources import parse_source
from serve_app.server.lora import AdapterSet
from tests.support.fake_engine import FakeLoRAModels, noop
from tests.support.hub_server import HubServer
from tests.support.s3_server import S3Server

MODEL = models_dir() / DEFAULT_MODEL_NAME
COMMIT = "5f3c1b7e0a9d2c4b6e8f0a1b3c5d7e9f1a2b4c6d"
HUB_MODEL = f"mesh-test/{DEFAULT_MODEL_NAME}"
ACME = load_manifest()["acme-support@v1"]
GLOBEX = load_manifest()["globex-report@v1"]


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    server.start()
    server.upload(MODEL, "models", DEFAULT_MODEL_NAME)
    server.upload(REPO_ROOT / ACME.uri, "adapters", "acme-support/v1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hub():
    server = HubServer({HUB_MODEL: (COMMIT, MODEL),
                        "mesh-test/globex-report": (COMMIT, REPO_ROOT / GLOBEX.uri)}).start()
    yield server
    server.stop()


@pytest.fixture
def node(tmp_path, monkeypatch, s3, hub):
    """A fresh node: its own cache and hub cache, the endpoints in its environment."""
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    s3.vanish_during(None)
    s3.object_gets.clear()
    hub.requests.clear()
    return tmp_path


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    return names == sorted(p.name for p in b.iterdir()) and all(
        sha256_file(a / n) == sha256_file(b / n) for n in names)


# -- models -------------------------------------------------------------------------------

def test_a_model_from_a_bucket_is_fetched_once_per_node(node, s3):
    uri = f"s3://models/{DEFAULT_MODEL_NAME}"
    assert cached_model(uri) is None
    path = fetch_model(uri)
    assert path == bucket_cache_dir(parse_source(uri)) and same_files(path, MODEL)
    gets = len(s3.object_gets)
    assert fetch_model(uri) == path and len(s3.object_gets) == gets  # reused: listed only
    assert cached_model(uri) == path


def test_replicas_starting_together_download_once(node, s3):
    uri = f"s3://models/{DEFAULT_MODEL_NAME}"
    paths, errors = [], []

    def start():
        try:
            paths.append(fetch_model(uri))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(set(paths)) == 1 and len(paths) == 3
    assert sum(g.endswith("/model.safetensors") for g in s3.object_gets) == 1


def test_a_bucket_lost_mid_download_is_a_clean_failure(node, s3):
    uri = f"s3://models/{DEFAULT_MODEL_NAME}"
    s3.vanish_during("model.safetensors")
    with pytest.raises(FetchError, match=rf"download of {uri} failed at 'model.safetensors' "
                                         r"after [0-9.]+ of 272.6 MB: .*NoSuchBucket"):
        fetch_model(uri)
    assert s3.vanished.is_set()
    folder = bucket_cache_dir(parse_source(uri))
    assert not folder.exists() and not list(folder.parent.iterdir())  # nothing partial left
    assert cached_model(uri) is None
    s3.vanish_during(None)  # the bucket is back: the next start fetches it whole
    assert same_files(fetch_model(uri), MODEL)


def test_a_missing_folder_is_refused_with_its_uri(node):
    with pytest.raises(FetchError, match=r"s3://models/nothing-here holds no objects"):
        fetch_model("s3://models/nothing-here")


def test_a_model_from_the_hub_at_a_pinned_commit(node, hub, monkeypatch):
    path = fetch_model(HUB_MODEL, COMMIT)
    assert path.parent.name == "snapshots" and path.name == COMMIT
    assert same_files(path, MODEL)
    assert hub.requests[f"{HUB_MODEL}/model.safetensors"] == 1
    assert fetch_model(f"hf://{HUB_MODEL}", COMMIT) == path  # from the cache
    assert hub.requests[f"{HUB_MODEL}/model.safetensors"] == 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # honoured: served from the cache, no network
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert fetch_model(HUB_MODEL, COMMIT) == path


def test_the_hub_offline_without_a_cache_is_refused(node, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FetchError, match=rf"could not fetch model hf://{HUB_MODEL}@5f3c1b7e0a9d"
                                         r": HF_HUB_OFFLINE is set and the hub cache"):
        fetch_model(HUB_MODEL, COMMIT)


def test_a_commit_the_hub_does_not_have_is_refused(node):
    with pytest.raises(FetchError, match=r"RevisionNotFoundError"):
        fetch_model(HUB_MODEL, "f" * 40)


# -- adapters -----------------------------------------------------------------------------

class RecordingModels(FakeLoRAModels):
    """Records, per load, the path vLLM was given and the SHA-256 of the weights there."""

    def __init__(self):
        super().__init__()
        self.loaded: list[tuple[str, Path, str]] = []

    async def load_lora_adapter(self, request):
        path = Path(request.lora_path)
        self.loaded.append((request.lora_name, path, sha256_file(path / WEIGHTS_FILE)))
        return await super().load_lora_adapter(request)


def registry(tmp: Path, entries: list[dict]) -> Path:
    manifest = tmp / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"adapters": entries}, sort_keys=False))
    return manifest


def entry(spec, **changes) -> dict:
    return {**spec.model_dump(), **changes}


def adapter_set(models) -> AdapterSet:
    return AdapterSet(models, SimpleNamespace(remove_lora=noop), base_model=DEFAULT_MODEL_NAME,
                      max_lora_rank=16, max_cpu_loras=4)


def test_adapters_from_a_bucket_and_the_hub_load_from_private_copies(node):
    manifest = registry(node, [
        entry(ACME, uri="s3://adapters/acme-support/v1"),
        entry(GLOBEX, uri="hf://mesh-test/globex-report", revision=COMMIT)])
    models = RecordingModels()
    adapters = adapter_set(models)
    asyncio.run(adapters.reconcile([("acme-support", 1), ("globex-report", 1)], manifest))
    assert not adapters.refused and not adapters.load_errors
    assert [(n, p, h) for n, p, h in models.loaded] == [
        ("acme-support@v1", adapter_cache.copy_path(ACME), ACME.sha256),
        ("globex-report@v1", adapter_cache.copy_path(GLOBEX), GLOBEX.sha256)]
    copy = adapter_cache.copy_path(ACME)
    assert os.stat(copy.parent).st_mode & 0o777 == 0o700  # private
    assert all(not os.access(p, os.W_OK) or os.geteuid() == 0 for p in copy.iterdir())
    assert all(p.stat().st_mode & 0o222 == 0 for p in copy.iterdir())  # read-only


def test_a_source_replaced_after_reconcile_is_refused_never_served(node):
    """The issue's reproduction: reconcile checks the source, the lazy first load used to
    hand vLLM the source path unchecked. Now the load copies, hashes the copy, refuses."""
    source = node / "acme"
    shutil.copytree(REPO_ROOT / ACME.uri, source)
    manifest = registry(node, [entry(GLOBEX, uri=str(REPO_ROOT / GLOBEX.uri)),
                               entry(ACME, uri=str(source))])
    models = RecordingModels()
    adapters = adapter_set(models)

    async def main():
        # one slot: globex warms, acme is declared (verified at its source) but not loaded
        await adapters.reconcile([("globex-report", 1), ("acme-support", 1)], manifest,
                                 max_resident=1)
        assert "acme-support@v1" in adapters.active and not adapters.refused
        replaced = (source / WEIGHTS_FILE).read_bytes()[::-1]
        (source / WEIGHTS_FILE).write_bytes(replaced)  # the source changes after reconcile
        with pytest.raises(MeshError, match="SHA-256 mismatch") as refusal:
            await adapters.acquire("acme-support", wait_s=5)
        assert refusal.value.status == 503 and refusal.value.code == "adapter_load_failed"
        assert [n for n, _, _ in models.loaded] == ["globex-report@v1"]  # never reached vLLM
        assert not adapter_cache.copy_path(ACME).exists()  # nothing of it cached

        shutil.copy(REPO_ROOT / ACME.uri / WEIGHTS_FILE, source / WEIGHTS_FILE)  # restored
        live = await adapters.acquire("acme-support", wait_s=5)
        adapters.release(live)
        (source / WEIGHTS_FILE).write_bytes(replaced)  # replaced again, after the copy
        live = await adapters.acquire("globex-report", wait_s=5)  # evicts acme
        adapters.release(live)
        live = await adapters.acquire("acme-support", wait_s=5)  # reload: from the copy
        adapters.release(live)
        loads = [(n, h) for n, _, h in models.loaded]
        assert loads[1:] == [("acme-support@v1", ACME.sha256), ("globex-report@v1",
                             GLOBEX.sha256), ("acme-support@v1", ACME.sha256)]
        assert hashlib.sha256(replaced).hexdigest() not in {h for _, h in loads}
    asyncio.run(main())


def test_a_private_copy_changed_on_disk_is_refused_before_the_reload(node):
    manifest = registry(node, [entry(GLOBEX, uri=str(REPO_ROOT / GLOBEX.uri)),
                               entry(ACME, uri=str(REPO_ROOT / ACME.uri))])
    models = RecordingModels()
    adapters = adapter_set(models)

    async def main():
        await adapters.reconcile([("acme-support", 1), ("globex-report", 1)], manifest,
                                 max_resident=1)  # acme warm, from its copy
        copy = adapter_cache.copy_path(ACME)
        live = await adapters.acquire("globex-report", wait_s=5)  # evicts acme
        adapters.release(live)
        os.chmod(copy, 0o755)
        os.chmod(copy / WEIGHTS_FILE, 0o644)
        (copy / WEIGHTS_FILE).write_bytes(b"not the registered weights")
        with pytest.raises(MeshError, match=r"its private copy .* changed .* refused and "
                                            r"removed"):
            await adapters.acquire("acme-support", wait_s=5)
        assert not copy.exists()
        live = await adapters.acquire("acme-support", wait_s=5)  # copied again from source
        adapters.release(live)
        assert [(n, h) for n, _, h in models.loaded] == [
            ("acme-support@v1", ACME.sha256), ("globex-report@v1", GLOBEX.sha256),
            ("acme-support@v1", ACME.sha256)]
    asyncio.run(main())
