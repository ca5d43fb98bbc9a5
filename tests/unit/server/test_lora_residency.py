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
from bench.adapter_copies import register_copies
from tests.support.fake_engine import FakeLoRAModels


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


def test_a_wait_for_an_adapter_slot_ends_in_adapter_capacity_and_evicts_nothing(copies):
    """Issue 28: with its one slot held by a running request, a request for another adapter
    waits its ``wait_s`` (the route's ``queue_timeout_s``), then gets 503 ``adapter_capacity``
    with ``Retry-After``; nothing was evicted or loaded for it, and its count is given back."""
    manifest, refs = copies
    adapters, rec = adapter_set(FakeLoRAModels())

    async def main():
        await adapters.reconcile(refs[:2], manifest, max_resident=1)
        held = await adapters.acquire(refs[0][0])  # a long stream holds the only slot
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(MeshError) as refused:
            await adapters.acquire(refs[1][0], wait_s=0.2)
        waited = loop.time() - t0
        adapters.release(held)
        await asyncio.sleep(0.05)  # a load left behind would evict the idle one now
        return refused.value, waited, held

    e, waited, held = asyncio.run(main())
    assert (e.status, e.code) == (503, "adapter_capacity"), e.message
    assert int(e.headers["Retry-After"]) > 0 and "max_adapters_per_replica" in e.message
    assert 0.2 <= waited < 1.0
    assert adapters.resident_names() == [held.lora_name]
    assert rec.count("evicted") == 0 and rec.count("loaded") == 1
    assert adapters.active[f"{refs[1][0]}@v1"].in_flight == 0


def test_a_waiter_that_leaves_drops_its_load_and_one_that_stays_gets_it(copies):
    """Issue 28: the only request waiting for a load leaves (its client disconnected): the
    load is dropped, so releasing the slot evicts nothing. A load with a waiter left after
    another leaves still happens."""
    manifest, refs = copies
    adapters, rec = adapter_set(FakeLoRAModels())

    async def main():
        await adapters.reconcile(refs[:3], manifest, max_resident=1)
        held = await adapters.acquire(refs[0][0])
        gone = asyncio.ensure_future(adapters.acquire(refs[1][0], wait_s=30))
        await asyncio.sleep(0.05)
        gone.cancel()  # the client left
        await asyncio.gather(gone, return_exceptions=True)
        adapters.release(held)
        await asyncio.sleep(0.05)
        after_leaving = (adapters.resident_names(), rec.count("evicted"))
        held = await adapters.acquire(refs[0][0])
        a = asyncio.ensure_future(adapters.acquire(refs[2][0], wait_s=30))
        b = asyncio.ensure_future(adapters.acquire(refs[2][0], wait_s=30))
        await asyncio.sleep(0.05)
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        adapters.release(held)
        live = await asyncio.wait_for(b, 5)
        return after_leaving, live

    (resident, evicted), live = asyncio.run(main())
    assert resident == [f"{refs[0][0]}@v1"] and evicted == 0
    assert adapters.resident_names() == [live.lora_name] == [f"{refs[2][0]}@v1"]


def test_an_adapter_is_removed_only_once_the_engine_holds_no_request_on_it(copies):
    """Issue 28: a client left mid-stream, so the request is released here while vLLM has not
    yet aborted it; the eviction that a waiting load makes removes the adapter from the engine
    only after the engine's own state (its output processor) no longer holds that request."""
    manifest, refs = copies
    removed: list[tuple[int, int]] = []  # (lora_int_id, engine requests on it at removal)
    states: dict[str, SimpleNamespace] = {}

    async def remove_lora(lora_int_id):
        removed.append((lora_int_id, sum(1 for s in states.values()
                                         if s.lora_name == f"{refs[0][0]}@v1")))

    engine = SimpleNamespace(remove_lora=remove_lora,
                             output_processor=SimpleNamespace(request_states=states))
    adapters = AdapterSet(FakeLoRAModels(), engine, base_model=DEFAULT_MODEL_NAME,
                          max_lora_rank=16, max_cpu_loras=8)

    async def main():
        await adapters.reconcile(refs[:2], manifest, max_resident=1)
        held = await adapters.acquire(refs[0][0])
        states["chatcmpl-1"] = SimpleNamespace(lora_name=held.lora_name)  # in the engine
        waiting = asyncio.ensure_future(adapters.acquire(refs[1][0], wait_s=30))
        await asyncio.sleep(0.05)
        adapters.release(held)  # released before vLLM has aborted it
        await asyncio.sleep(0.2)
        assert not removed and not waiting.done()  # the eviction waits for the engine
        del states["chatcmpl-1"]  # vLLM aborted it
        return await asyncio.wait_for(waiting, 5)

    live = asyncio.run(main())
    assert len(removed) == 1 and removed[0][1] == 0
    assert adapters.resident_names() == [live.lora_name]



def test_a_lowered_max_resident_holds_at_once_for_idle_adapters_and_later_for_busy_ones(copies):
    """Before, lowering max_adapters_per_replica left every resident adapter loaded, so a
    replica with 4 resident and a bound of 1 still served all 4 as hits."""
    manifest, refs = copies
    adapters, rec = adapter_set(FakeLoRAModels())

    async def main():
        await adapters.reconcile(refs[:4], manifest, max_resident=4)
        busy = await adapters.acquire(refs[1][0])
        await adapters.reconcile(refs[:4], manifest, max_resident=1)
        await asyncio.sleep(0.05)
        after_lowering = adapters.resident_names()
        adapters.release(busy)
        await asyncio.sleep(0.05)
        return after_lowering, adapters.resident_names()

    after_lowering, after_release = asyncio.run(main())
    assert after_lowering == [f"{refs[1][0]}@v1"]  # the idle three went at once
    assert after_release == [f"{refs[1][0]}@v1"]  # at the bound, it stays
    assert rec.count("evicted") == 3
