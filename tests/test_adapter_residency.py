"""Unit tests of declared vs resident adapters (:class:`AdapterSet`): the real registry checks
over registered copies of the demo adapters, a fake for vLLM's LoRA loader, no engine.
``test_many_adapters.py`` runs the same on real engines."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from serve_app.common.adapters import AdapterError
from serve_app.common.errors import MeshError
from serve_app.common.paths import DEFAULT_MODEL_NAME
from serve_app.server.lora import AdapterSet
from serve_app.tools.adapter_copies import register_copies
from test_replica_server import FakeLoRAModels


async def _noop(*_):
    return None


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, key, event, seconds):
        self.events.append((key, event))

    def count(self, event: str) -> int:
        return sum(1 for _, e in self.events if e == event)


def adapter_set(models: FakeLoRAModels, max_cpu_loras: int = 8) -> tuple[AdapterSet, Recorder]:
    rec = Recorder()
    return AdapterSet(models, SimpleNamespace(remove_lora=_noop), base_model=DEFAULT_MODEL_NAME,
                      max_lora_rank=16, max_cpu_loras=max_cpu_loras, on_event=rec), rec


@pytest.fixture
def copies(tmp_path):
    manifest, names = register_copies(32, tmp_path / "registry")
    return manifest, [(n, 1) for n in names]


def test_32_declared_4_resident_lru_of_the_idle_ones(copies):
    manifest, refs = copies
    models = FakeLoRAModels()
    adapters, rec = adapter_set(models)

    async def main():
        await adapters.reconcile(refs, manifest, max_resident=4)
        assert len(adapters.active) == 32 and not adapters.refused
        assert adapters.resident_names() == [f"{n}@v1" for n, _ in refs[:4]]  # warmed in order
        for name, _ in refs:  # every declared adapter serves, one after another
            live = await adapters.acquire(name)
            assert live.lora_name in adapters.resident and len(adapters.resident) <= 4
            adapters.release(live)
        # the LRU order is the order of use: the last four stay
        assert adapters.resident_names() == [f"{n}@v1" for n, _ in refs[-4:]]
        # using the oldest of those moves it to the end, so the next load evicts another
        await asyncio.sleep(0)
        adapters.release(await adapters.acquire(refs[-4][0]))
        adapters.release(await adapters.acquire(refs[0][0]))
        return adapters.resident_names()

    resident = asyncio.run(main())
    assert resident == [f"{n}@v1" for n, _ in (refs[-2], refs[-1], refs[-4], refs[0])]
    assert rec.count("loaded") == 4 + 28 + 1 and rec.count("evicted") == 29
    assert set(models.lora_requests) == set(resident)  # vLLM holds exactly the resident ones


def test_an_adapter_in_flight_is_never_evicted(copies):
    manifest, refs = copies
    adapters, rec = adapter_set(FakeLoRAModels())

    async def main():
        await adapters.reconcile(refs[:10], manifest, max_resident=2)
        held = await adapters.acquire(refs[0][0])  # a long stream on adapter 0
        for name, _ in refs[1:9]:  # eight others load in turn
            live = await adapters.acquire(name)
            assert held.lora_name in adapters.resident
            adapters.release(live)
        still = held.lora_name in adapters.resident
        adapters.release(held)
        return still

    assert asyncio.run(main())
    assert (refs[0][0] + "@v1", "evicted") not in rec.events


def test_a_burst_for_a_cold_adapter_loads_it_once(copies):
    manifest, refs = copies
    models = FakeLoRAModels(load_s=0.05)
    adapters, rec = adapter_set(models)

    async def main():
        await adapters.reconcile(refs[:6], manifest, max_resident=2)
        cold = refs[5][0]
        burst = await asyncio.gather(*(adapters.acquire(cold) for _ in range(8)))
        assert {live.lora_name for live in burst} == {f"{cold}@v1"}
        assert adapters.active[f"{cold}@v1"].in_flight == 8
        for live in burst:
            adapters.release(live)
        return cold

    cold = asyncio.run(main())
    assert models.loads.count(f"{cold}@v1") == 1
    assert rec.count("waited") == 8


def test_when_every_resident_adapter_is_in_use_a_load_waits_for_a_release(copies):
    manifest, refs = copies
    adapters, _ = adapter_set(FakeLoRAModels())

    async def main():
        await adapters.reconcile(refs[:3], manifest, max_resident=2)
        a, b = await adapters.acquire(refs[0][0]), await adapters.acquire(refs[1][0])
        waiting = asyncio.ensure_future(adapters.acquire(refs[2][0]))
        await asyncio.sleep(0.05)
        assert not waiting.done() and len(adapters.resident) == 2
        adapters.release(b)
        c = await asyncio.wait_for(waiting, 1)
        resident = adapters.resident_names()
        adapters.release(a), adapters.release(c)
        return resident

    assert asyncio.run(main()) == [f"{refs[0][0]}@v1", f"{refs[2][0]}@v1"]


def test_a_retired_adapter_finishes_its_requests_then_unloads(copies):
    manifest, refs = copies
    models = FakeLoRAModels()
    adapters, _ = adapter_set(models)

    async def main():
        await adapters.reconcile(refs[:2], manifest)
        held = await adapters.acquire(refs[0][0])
        await adapters.reconcile(refs[1:2], manifest)  # adapter 0 removed from the config
        with pytest.raises(MeshError) as e:
            await adapters.acquire(refs[0][0])
        assert e.value.status == 404
        draining = dict(adapters.status()["retiring"])
        adapters.release(held)
        await asyncio.sleep(0.01)
        return draining

    assert asyncio.run(main()) == {f"{refs[0][0]}@v1": {"in_flight": 1}}
    assert set(models.lora_requests) == {f"{refs[1][0]}@v1"}


def test_a_failed_load_is_a_503_the_adapter_stays_declared_and_the_next_request_retries(copies):
    manifest, refs = copies
    broken = f"{refs[3][0]}@v1"
    models = FakeLoRAModels(broken=(broken,))
    adapters, _ = adapter_set(models)

    async def main():
        await adapters.reconcile(refs[:4], manifest, max_resident=2)
        for _ in range(2):
            with pytest.raises(MeshError) as e:
                await adapters.acquire(refs[3][0])
            assert (e.value.status, e.value.body()["error"]["code"]) == (
                503, "adapter_load_failed")
        assert "bad tensor shapes" in adapters.load_errors[broken]
        assert broken in adapters.active and adapters.active[broken].in_flight == 0
        models.broken = ()
        live = await adapters.acquire(refs[3][0])  # fixed: it loads now
        adapters.release(live)
        return adapters.load_errors

    assert asyncio.run(main()) == {}


def test_an_adapter_retired_and_declared_again_while_it_loads_stays_one_object(copies):
    manifest, refs = copies
    adapters, _ = adapter_set(FakeLoRAModels(load_s=0.05))

    async def main():
        await adapters.reconcile(refs[:1], manifest, max_resident=2)
        key = f"{refs[1][0]}@v1"
        await adapters.reconcile(refs[:2], manifest, max_resident=1)  # no room: cold
        first = asyncio.ensure_future(adapters.acquire(refs[1][0]))
        await asyncio.sleep(0)
        await adapters.reconcile(refs[:1], manifest, max_resident=2)  # retired mid-load
        await adapters.reconcile(refs[:2], manifest, max_resident=2)  # and declared again
        live = await first
        again = await adapters.acquire(refs[1][0])
        same = again is live and adapters.resident[key] is live and live.in_flight == 2
        adapters.release(live), adapters.release(again)
        return same

    assert asyncio.run(main())


def test_max_adapters_per_replica_above_max_cpu_loras_is_refused_with_the_fix(copies):
    manifest, refs = copies
    adapters, _ = adapter_set(FakeLoRAModels(), max_cpu_loras=4)
    with pytest.raises(AdapterError, match="max_cpu_loras=4"):
        asyncio.run(adapters.reconcile(refs[:2], manifest, max_resident=5))
    assert adapters.active == {}
