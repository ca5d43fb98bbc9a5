"""Models and adapters fetched from a bucket and from the hub, over the real protocols: moto's
S3 server and a local hub for the real ``huggingface_hub`` client, both on 127.0.0.1
(tests/support). Fetched once per node into the cache; a partial download is a clean failure;
an adapter is loaded from a private copy hashed again right before every load."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from serve_app.common import adapter_cache
from serve_app.common.adapters import (CONFIG_FILE, WEIGHTS_FILE, AdapterError, load_manifest,
                                       manifest_file, sha256_file)
from serve_app.common.errors import MeshError
from serve_app.common.bucket_fetch import bucket_cache_dir
from serve_app.common.fetch import FetchError, cached_model, fetch, fetch_file, fetch_model
from serve_app.common.fetch_guards import short_error
from serve_app.common.node_cache import STALE_AFTER_S, node_lock, sweep_leftovers
from serve_app.common.paths import DEFAULT_MODEL_NAME, REPO_ROOT, models_dir
from serve_app.common.sources import (BUCKET, Source, SourceError, parse_file_source,
                                      parse_source)
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


# -- nothing written outside the cache ------------------------------------------------------

def test_a_source_that_climbs_is_refused_before_anything_is_written(node, s3):
    """The issue's reproduction: the prefix's '..' parts used to be joined into the cache
    path, and the fetch then renamed that folder away, deleted it and refilled it."""
    victim = node / "victim"
    victim.mkdir()
    (victim / "id_ed25519").write_text("mine")
    with pytest.raises(SourceError, match="it has a path part '..'"):
        fetch_model("s3://models/../../../victim")
    rel = os.path.relpath(victim, node / "cache" / "buckets" / "s3" / "models")
    climbing = Source(BUCKET, "made by hand", f"s3://models/{rel}")  # past parse_source
    with pytest.raises(FetchError, match=r"s3://models/\.\./\.\./\.\./\.\./victim: it has a "
                                         r"path part '\.\.'; refused"):
        fetch(climbing)
    assert [p.name for p in victim.iterdir()] == ["id_ed25519"]
    assert (victim / "id_ed25519").read_text() == "mine" and not s3.object_gets


def test_an_object_key_that_would_climb_refuses_the_whole_prefix(node, s3):
    s3.client().put_object(Bucket="models", Key="keyed/config.json", Body=b"{}")
    s3.client().put_object(Bucket="models", Key="keyed/%2e%2e/%2e%2e/escape", Body=b"x")
    with pytest.raises(FetchError, match=r"s3://models/keyed: object '%2e%2e/%2e%2e/escape': "
                                         r"it has a path part '%2e%2e' \(percent-encoded "
                                         r"'\.\.'\); it would land outside its folder"):
        fetch_model("s3://models/keyed")
    assert not s3.object_gets and not bucket_cache_dir(parse_source("s3://models/keyed")).exists()


def test_a_link_in_the_cache_that_leads_out_is_not_followed(node, s3):
    outside = node / "outside"
    outside.mkdir()
    (node / "cache" / "buckets" / "s3").mkdir(parents=True)
    (node / "cache" / "buckets" / "s3" / "models").symlink_to(outside)
    with pytest.raises(FetchError, match=rf"s3://models/{DEFAULT_MODEL_NAME} would be written "
                                         rf"at {outside}/{DEFAULT_MODEL_NAME}, outside "):
        fetch_model(f"s3://models/{DEFAULT_MODEL_NAME}")
    assert not list(outside.iterdir()) and not s3.object_gets


def test_a_hub_file_name_that_would_climb_is_refused_before_any_download(node, monkeypatch):
    hub = HubServer({"mesh-test/hostile": (COMMIT, REPO_ROOT / GLOBEX.uri)}).start()
    try:
        hub.list_also("mesh-test/hostile", "../../../../../escape.txt")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(FetchError, match=r"hf://mesh-test/hostile@5f3c1b7e0a9d: the hub "
                                             r"lists a file '\.\./\.\./\.\./\.\./\.\./escape"
                                             r"\.txt': it has a path part '\.\.'"):
            fetch_model("mesh-test/hostile", COMMIT)
        assert not hub.requests  # nothing of the repo was downloaded
    finally:
        hub.stop()
    assert not list(node.rglob("escape.txt"))


# -- caps, ETags, leftovers -----------------------------------------------------------------

def test_a_download_over_its_caps_is_refused_before_the_first_byte(node, s3, monkeypatch):
    uri = f"s3://models/{DEFAULT_MODEL_NAME}"
    files = [p for p in MODEL.iterdir() if p.is_file()]
    n, total = len(files), sum(p.stat().st_size for p in files)
    monkeypatch.setenv("MESH_FETCH_MAX_OBJECTS", str(n - 1))
    with pytest.raises(FetchError, match=rf"^{uri} holds {n} objects, over the cap of {n - 1} "
                                         r"\(MESH_FETCH_MAX_OBJECTS\): point the URI at"):
        fetch_model(uri)
    monkeypatch.setenv("MESH_FETCH_MAX_OBJECTS", str(n))
    monkeypatch.setenv("MESH_FETCH_MAX_BYTES", str(total - 1))
    with pytest.raises(FetchError, match=rf"^{uri} holds {total} bytes \(0\.3 GB\), over the "
                                         rf"cap of {total - 1} bytes"):
        fetch_model(uri)
    monkeypatch.setenv("MESH_FETCH_MAX_BYTES", "lots")
    with pytest.raises(FetchError, match=r"MESH_FETCH_MAX_BYTES='lots' is not a whole number"):
        fetch_model(uri)
    assert not s3.object_gets and cached_model(uri) is None
    monkeypatch.setenv("MESH_FETCH_MAX_BYTES", str(total))  # at the cap: fetched
    assert same_files(fetch_model(uri), MODEL)


def test_a_hub_download_over_its_caps_is_refused_before_the_first_byte(node, hub, monkeypatch):
    monkeypatch.setenv("MESH_FETCH_MAX_OBJECTS", "2")
    with pytest.raises(FetchError, match=rf"hf://{HUB_MODEL}@5f3c1b7e0a9d holds \d+ objects, "
                                         r"over the cap of 2"):
        fetch_model(HUB_MODEL, COMMIT)
    assert not hub.requests


def test_an_object_replaced_during_the_download_is_a_clean_failure(node, s3):
    """Objects are fetched only while their ETag is the listing's: one replaced between the
    listing and its download (same size: the size check cannot see it) used to give a
    folder of two versions."""
    uri = s3.upload(REPO_ROOT / ACME.uri, "adapters", "replaced/v1")
    weights = (REPO_ROOT / ACME.uri / WEIGHTS_FILE).read_bytes()
    s3.replace_during(f"replaced/v1/{WEIGHTS_FILE}", weights[::-1])
    with pytest.raises(FetchError, match=rf"{uri}/{WEIGHTS_FILE} was replaced during the "
                                         r"download \(its ETag is no longer the listing's "
                                         r"\"[0-9a-f]+\"\); nothing was kept, the next fetch "
                                         r"retries"):
        fetch_model(uri)
    dest = bucket_cache_dir(parse_source(uri))
    assert not dest.exists() and not list(dest.parent.iterdir())
    again = fetch_model(uri)  # the next fetch lists the new object and takes it
    assert (again / WEIGHTS_FILE).read_bytes() == weights[::-1]


def test_leftovers_of_killed_fetches_go_unless_a_fetch_holds_them(node, s3):
    cache = node / "cache"
    folder = cache / "buckets" / "s3" / "models"
    copies = cache / "adapters"
    stale = [folder / f".{DEFAULT_MODEL_NAME}.partial-0123abcd", folder / ".gone.old-89abcdef",
             copies / f".{ACME.digest}.partial-2468ace0"]
    fresh = folder / ".fresh.partial-00000000"
    busy = folder / ".busy.partial-11111111"
    for p in [*stale, fresh, busy]:
        (p / "sub").mkdir(parents=True)
        (p / "sub" / "model.safetensors").write_bytes(b"half")
    os.chmod(stale[2] / "sub", 0o555)  # an adapter copy is made read-only
    long_ago = time.time() - 2 * STALE_AFTER_S
    for p in [*stale, busy]:
        os.utime(p, (long_ago, long_ago))
    with node_lock("s3://models/busy"):  # a fetch of it runs now (another replica)
        removed = sweep_leftovers(force=True)
    assert sorted(removed) == sorted(stale)
    assert not any(p.exists() for p in stale) and fresh.exists() and busy.exists()
    assert sweep_leftovers() == []  # once per process
    # a fetch removes its own source's stale leftovers under its lock, and its neighbours'
    # whose lock is free now (the busy one's fetch ended)
    mine = folder / f".{DEFAULT_MODEL_NAME}.partial-fedcba98"
    mine.mkdir()
    os.utime(mine, (long_ago, long_ago))
    fetch_model(f"s3://models/{DEFAULT_MODEL_NAME}")
    assert not mine.exists() and not busy.exists() and fresh.exists()


# -- no credential in a message or a log line ------------------------------------------------

@pytest.mark.parametrize("module", ["fetch", "hub_fetch", "bucket_fetch", "node_cache"])
def test_fetch_errors_and_log_lines_carry_no_credential(node, caplog, module):
    import importlib
    import logging

    logger = importlib.import_module(f"serve_app.common.{module}").logger
    secret = "wJalrSECRETKEY"
    err = FetchError(f"could not list s3://AKIAEXAMPLE:{secret}@b/x: GET "
                     "https://b.s3.amazonaws.com/x?X-Amz-Signature=SIGNED99 failed")
    assert secret not in str(err) and "SIGNED99" not in str(err) and "***" in str(err)
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("fetching %s", f"https://h/x?sig={secret}")
    assert caplog.records and secret not in caplog.text
    assert short_error(RuntimeError(f"see s3://k:{secret}@b/x")).endswith("s3://***@b/x")


# -- one file: an adapter registry in a bucket or on the hub ---------------------------------

def test_a_registry_in_a_bucket_is_read_again_at_every_fetch(node, s3, caplog):
    s3.client().put_object(Bucket="adapters", Key="registry/manifest.yaml",
                           Body=b"adapters: []\n")
    source = parse_file_source("s3://adapters/registry/manifest.yaml")
    path = fetch_file(source)
    assert path == node / "cache" / "files" / "s3" / "adapters" / "registry" / "manifest.yaml"
    assert path.read_text() == "adapters: []\n"
    s3.client().put_object(Bucket="adapters", Key="registry/manifest.yaml",
                           Body=b"adapters: [] # edited\n")
    assert fetch_file(source).read_text() == "adapters: [] # edited\n"  # a registry is edited
    s3.gone = True  # the bucket cannot be reached: the copy read before serves, with a warning
    try:
        assert fetch_file(source) == path
    finally:
        s3.gone = False
    assert "cannot be read" in caplog.text and "using the copy fetched before" in caplog.text
    with pytest.raises(FetchError, match=r"could not read s3://adapters/nothing\.yaml"):
        fetch_file(parse_file_source("s3://adapters/nothing.yaml"))


def test_a_registry_on_the_hub_is_read_at_its_commit(node, monkeypatch, tmp_path):
    repo = tmp_path / "registry-repo"
    repo.mkdir()
    (repo / "manifest.yaml").write_text("adapters: []\n")
    hub = HubServer({"mesh-test/registry": (COMMIT, repo)}).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        path = manifest_file(f"hf://mesh-test/registry@{COMMIT}/manifest.yaml")
        assert path.read_text() == "adapters: []\n" and path.parent.name == COMMIT
        assert load_manifest(path) == {}
    finally:
        hub.stop()


# -- a private copy is keyed by everything that makes the adapter ---------------------------

def with_config(src: Path, dest: Path, **changes) -> Path:
    """A copy of adapter folder ``src`` at ``dest`` with ``changes`` in its config."""
    shutil.copytree(src, dest)
    config = json.loads((dest / CONFIG_FILE).read_text())
    (dest / CONFIG_FILE).write_text(json.dumps({**config, **changes}, indent=2))
    return dest


def test_two_versions_with_the_same_weights_never_share_a_copy(node):
    """The issue's case: v2 only fixes lora_alpha. Keyed by the weights alone, v2 was served
    from v1's copy, with v1's config."""
    v2_dir = with_config(REPO_ROOT / ACME.uri, node / "acme-v2", lora_alpha=32)
    manifest = registry(node, [
        entry(ACME, uri=str(REPO_ROOT / ACME.uri)),
        entry(ACME, version=2, uri=str(v2_dir), config_sha256=sha256_file(v2_dir / CONFIG_FILE))])
    models = RecordingModels()
    adapters = adapter_set(models)
    asyncio.run(adapters.reconcile([("acme-support", 1), ("acme-support", 2)], manifest))
    assert not adapters.refused and not adapters.load_errors
    paths = {name: path for name, path, _ in models.loaded}
    assert paths["acme-support@v1"] != paths["acme-support@v2"]
    alphas = {n: json.loads((p / CONFIG_FILE).read_text())["lora_alpha"] for n, p in paths.items()}
    assert alphas == {"acme-support@v1": 16, "acme-support@v2": 32}
    assert {h for _, _, h in models.loaded} == {ACME.sha256}  # the same weights, twice


def test_a_config_edited_in_the_bucket_is_refused_never_served(node, s3):
    """Only the weights were pinned: a config edited at the source passed verification."""
    edited = with_config(REPO_ROOT / ACME.uri, node / "acme-edited", lora_alpha=512)
    uri = s3.upload(edited, "adapters", "acme-edited/v1")
    manifest = registry(node, [entry(ACME, uri=uri)])
    models = RecordingModels()
    adapters = adapter_set(models)

    async def main():
        await adapters.reconcile([("acme-support", 1)], manifest, max_resident=1)
        with pytest.raises(MeshError, match=r"SHA-256 mismatch for .*adapter_config\.json: "
                                            r"manifest config_sha256 f626fa3f9385\.\.\., file "):
            await adapters.acquire("acme-support", wait_s=5)
    asyncio.run(main())
    assert not models.loaded and not adapter_cache.copy_path(ACME).exists()


def test_a_private_copy_holds_only_the_registered_files(node):
    """A source folder's other files (a tokenizer vLLM would read, a README) are not copied;
    a file added to the copy later is refused before the next load."""
    source = node / "acme-extra"
    shutil.copytree(REPO_ROOT / ACME.uri, source)
    (source / "tokenizer_config.json").write_text("{}")
    spec = ACME.model_copy(update={"uri": str(source)})
    copy = adapter_cache.verified_copy(spec)
    assert sorted(p.name for p in copy.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    os.chmod(copy, 0o755)
    (copy / "tokenizer_config.json").write_text("{}")
    with pytest.raises(AdapterError, match=r"its private copy .* changed \(it holds "
                                           r"\['adapter_config.json', 'adapter_model"):
        adapter_cache.verified_copy(spec)
    assert not copy.exists()


def test_an_adapter_serves_only_on_its_base_model_at_its_revision(node):
    """A replica of a hub model checks each adapter's base_model and base_model_revision:
    another org's model of the same name, or another commit, is another model."""
    manifest = registry(node, [
        entry(ACME, uri=str(REPO_ROOT / ACME.uri), base_model=HUB_MODEL,
              base_model_revision=COMMIT),
        entry(GLOBEX, uri=str(REPO_ROOT / GLOBEX.uri), base_model=f"other-org/{DEFAULT_MODEL_NAME}",
              base_model_revision=COMMIT),
        entry(ACME, version=2, uri=str(REPO_ROOT / ACME.uri), base_model=HUB_MODEL,
              base_model_revision="f" * 40)])
    adapters = AdapterSet(RecordingModels(), SimpleNamespace(remove_lora=noop),
                          base_model=HUB_MODEL, base_revision=COMMIT, max_lora_rank=16,
                          max_cpu_loras=4)
    asyncio.run(adapters.reconcile([("acme-support", 1), ("globex-report", 1),
                                    ("acme-support", 2)], manifest))
    assert list(adapters.active) == ["acme-support@v1"]
    assert adapters.refused["globex-report@v1"].startswith(
        f"adapter globex-report@v1: trained for 'hf://other-org/{DEFAULT_MODEL_NAME}@{COMMIT}', "
        f"but this variant serves 'hf://{HUB_MODEL}@{COMMIT}' ({HUB_MODEL})")
    assert f"trained for 'hf://{HUB_MODEL}@{'f' * 40}'" in adapters.refused["acme-support@v2"]


def test_a_copy_that_cannot_be_written_is_that_adapter_s_refusal(node, monkeypatch):
    """A full disk while copying is an AdapterError (503 adapter_load_failed for that
    adapter), not an unexpected error; nothing half-made stays."""
    def full(src, dst, *a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(adapter_cache.shutil, "copyfile", full)
    spec = ACME.model_copy(update={"uri": str(REPO_ROOT / ACME.uri)})
    with pytest.raises(AdapterError, match=r"adapter acme-support@v1: could not make its "
                                           r"private copy in .*No space left on device"):
        adapter_cache.verified_copy(spec)
    assert not list(adapter_cache.copies_dir().iterdir())
