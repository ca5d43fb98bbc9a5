"""The chaos drill (bench/chaos.py) on the real stack: a canary at 90/10 with two router
replicas and acme's and globex's adapters on both variants, four client loops, and every
change and kill the drill knows in turn. A change loses nothing; a kill loses only what was
in flight on the killed process, and service is back within 10 s.

On the simulated engine (the default tier) one event every 6 s, about a minute and a
half; on real engines (``./scripts/test.sh --all``) one every 75 s, so a killed replica's
engine is back before the next kill of its kind."""

from __future__ import annotations

import asyncio

import pytest

from bench.chaos import EVENTS, KILLS, SERVICE_BACK_S, chaos_config, chaos_drill, summary

pytestmark = pytest.mark.integration


def test_changes_lose_nothing_and_kills_only_what_was_in_flight(mesh):
    cfg = chaos_config(mesh.config("tenants.yaml"))
    mesh.deploy(cfg)
    period_s = 6.0 if mesh.engine == "sim" else 75.0
    windows = asyncio.run(chaos_drill(mesh.base_url, cfg, mesh.deploy,
                                      period_s=period_s, events=len(EVENTS)))
    print("\n" + "\n".join(summary(windows)))
    assert [w.event.kind for w in windows] == list(EVENTS)
    assert all(w.answered > 0 for w in windows), [(w.event.kind, w.answered) for w in windows]
    for w in windows:
        assert w.held, w.line()
    for w in windows:
        if w.event.kind in KILLS:
            assert w.service_back_s is not None and w.service_back_s <= SERVICE_BACK_S, w.line()
