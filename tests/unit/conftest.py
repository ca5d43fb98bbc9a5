"""Unit tests write the node cache (adapters' private copies, fetched models) into a
temporary folder of the session, never into the user's ``~/.cache/model-mesh``."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_node_cache(tmp_path_factory):
    before = os.environ.get("MESH_CACHE_DIR")
    os.environ["MESH_CACHE_DIR"] = str(tmp_path_factory.mktemp("node-cache"))
    yield
    if before is None:
        os.environ.pop("MESH_CACHE_DIR", None)
    else:
        os.environ["MESH_CACHE_DIR"] = before
