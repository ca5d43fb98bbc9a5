"""The core promise on a route with one variant, where no failover can hide a refusal: every
kind of in-place change (docs/in-place-changes.md), applied with the real ``serve deploy``
while four client loops run (adapter stream, adapter non-stream, base stream, base
non-stream), refuses nothing: 0 non-200 answers and 0 in-band errors.

``tenants.yaml``'s route ``smollm`` has the single variant ``smollm-v1``, whose every
``reconfigure()`` takes 0.5 s on the simulated engine (``args.sim.reconfigure_s`` of the
sim tier, ``tests.support.mesh.TEST_SIM_ARGS``: Serve shows the replica UPDATING that long,
the window issue 31 found a 503 in); a second route ``smollm-b`` (smollm-v1 and smollm-v2) takes the weight changes.
The changes and :func:`~tests.support.in_place.soak` are in ``tests/support/in_place.py``,
shared with the short run on the real engine (``test_real_engine.py``).
"""

from __future__ import annotations

import copy

import pytest

from tests.support.in_place import CHANGES, router, soak, variant

pytestmark = pytest.mark.integration


def in_place_config(mesh) -> dict:
    cfg = mesh.config("tenants.yaml")
    v2 = copy.deepcopy(variant(cfg))
    v2["name"] = "smollm-v2"
    v2["deployments"][0]["user_config"] = {}
    cfg["applications"].append(v2)
    router(cfg)["routes"]["smollm-b"] = {"variants": [
        {"application": "smollm-v1", "weight": 90}, {"application": "smollm-v2", "weight": 10}]}
    return cfg


@pytest.fixture(scope="module")
def single_variant(mesh):
    cfg = in_place_config(mesh)
    mesh.deploy(cfg)
    return mesh, cfg


def test_every_in_place_kind_under_load_refuses_nothing_on_a_single_variant_route(
        single_variant):
    mesh, cfg = single_variant
    clients = soak(mesh, cfg, CHANGES)
    assert len(CHANGES) >= 20  # issue 31: 20 in-place changes
    failures = {c.name: c.failures[:5] for c in clients if c.failures}
    assert not failures, failures
    assert all(c.answers >= len(CHANGES) for c in clients), [(c.name, c.answers)
                                                              for c in clients]
    # both acme-support versions answered through the flips, and only those
    assert {a for c in clients for a in c.adapters} == {"acme-support@v1", "acme-support@v2"}
