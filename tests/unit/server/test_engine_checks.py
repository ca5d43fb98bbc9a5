"""The record of engine args vLLM accepted: a second build of the same args skips vLLM's
check; other args, another model file or a refusal are checked (no vLLM import here: the
check is faked)."""

from __future__ import annotations

import pytest

import serve_app.replica as replica
from serve_app.common import paths
from serve_app.common.config import VariantArgs
from serve_app.server import engine_checks

ARGS = {"model": "smollm2-135m-instruct", "served_model_name": "smollm",
        "engine_args": {"max_num_seqs": 4}}


@pytest.fixture
def checks(monkeypatch, tmp_path):
    monkeypatch.setenv("MESH_CACHE_DIR", str(tmp_path))
    seen = []

    def fake_engine_config(args):
        seen.append(args.engine_args)
        if args.engine_args.get("max_num_seqs", 1) < 0:
            raise ValueError("max_num_seqs must be positive")
    monkeypatch.setattr(replica, "engine_config", fake_engine_config)
    return seen


def test_accepted_args_are_checked_once(checks):
    replica.build_app(ARGS)
    replica.build_app(ARGS)
    assert checks == [{"max_num_seqs": 4}]
    replica.build_app({**ARGS, "engine_args": {"max_num_seqs": 6}})
    assert len(checks) == 2


def test_a_refusal_is_not_recorded(checks):
    bad = {**ARGS, "engine_args": {"max_num_seqs": -3}}
    for _ in range(2):
        with pytest.raises(ValueError, match="invalid engine_args.*max_num_seqs must be"):
            replica.build_app(bad)
    assert len(checks) == 2


def test_the_key_follows_the_model_files(checks, tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    args = VariantArgs.model_validate({**ARGS, "model": str(model)})
    key = engine_checks.check_key(args)
    (model / "config.json").write_text('{"a": 2}')
    assert engine_checks.check_key(args) != key


def test_an_unwritable_home_falls_back_to_the_temporary_directory(monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    monkeypatch.delenv("MESH_CACHE_DIR", raising=False)
    monkeypatch.setattr(paths.Path, "home", classmethod(lambda cls: home))
    monkeypatch.setattr(paths.os, "access", lambda path, mode: False)  # root writes all
    monkeypatch.setattr(paths.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert engine_checks._records() == tmp_path / "tmp" / "model-mesh" / "engine-checks"
    monkeypatch.setattr(paths.os, "access", lambda path, mode: True)
    assert engine_checks._records() == home / ".cache" / "model-mesh" / "engine-checks"


def test_a_sim_variant_is_not_checked_at_build(checks):
    """Its replica builds vLLM's config when it starts (serve_app/server/engine.py)."""
    replica.build_app({**ARGS, "engine": "sim"})
    assert checks == []


def test_a_model_fetched_at_replica_start_is_checked_there(checks):
    """A hub or bucket model not on this node: the build does not download it (the replica
    fetches it and builds the same VllmConfig at start); a local folder is checked at the
    build as before (a missing one fails it there: vLLM reads its config.json)."""
    replica.build_app({**ARGS, "model": "s3://models/llama", "engine_args": {"max_num_seqs": 2}})
    replica.build_app({**ARGS, "model": "org/llama", "revision": "a" * 40})
    assert checks == []
    replica.build_app({**ARGS, "model": "no-such-local-model"})
    assert checks == [{"max_num_seqs": 4}]
