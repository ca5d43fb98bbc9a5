"""The core promise on a route with one variant, where no failover can hide a refusal: every
kind of in-place change (docs/in-place-changes.md), applied with the real ``serve deploy``
while four client loops run (adapter stream, adapter non-stream, base stream, base
non-stream), refuses nothing: 0 non-200 answers and 0 in-band errors. Then two adapters
share the variant's one adapter slot under steady load while one of them flips version in
place: no adapter starves (each is answered between every two flips), and nothing fails.
Every change is deployed with ``Mesh.deploy(..., in_place=True)``: one that replaced a
replica fails the test, whatever the clients saw (``test_base_swap.py`` shows the check
failing an args change).

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

from tests.support.in_place import (CHANGES, adapter_contention_loops, adapter_versions, replica,
                                    router, soak, variant)

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


#: In-place flips of acme-support's version while two adapters share one slot.
FLIPS = [("adapter version", adapter_versions({"acme-support": v, "globex-report": 1}))
         for v in (2, 1, 2, 1)]


def test_two_adapters_sharing_one_slot_under_steady_load_and_flips_fail_nothing(
        single_variant):
    """Before slots were handed over, acme-support's two loops never left the one slot idle,
    and globex-report's requests waited out queue_timeout_s (503 adapter_capacity) again
    and again. Now globex gets the slot within a quarter of it, and acme gets it back: each
    loop is answered 4 times with no change at all (globex's one loop leaves the slot idle
    between its requests, and acme's take it: every globex answer after the first needs a
    hand-over), then through the flips."""
    mesh, _ = single_variant
    cfg = in_place_config(mesh)  # not the changes of the test before: no adapter version split
    replica(cfg)["user_config"].update(
        adapters=[{"name": "acme-support", "version": 1}, {"name": "globex-report", "version": 1}],
        max_adapters_per_replica=1)
    mesh.deploy(cfg)
    clients = soak(mesh, cfg, FLIPS, answered_between=True, clients=adapter_contention_loops(),
                   answers_before=4)
    failures = {c.name: c.failures[:5] for c in clients if c.failures}
    assert not failures, failures
    assert all(c.answers >= len(FLIPS) for c in clients), [(c.name, c.answers)
                                                           for c in clients]
    served = {a for c in clients for a in c.adapters}
    assert served == {"acme-support@v1", "acme-support@v2", "globex-report@v1"}

