"""Unit tests of adapter slots handed over under demand (:class:`AdapterSet`), and of a
request that waits for a slot being classed as capacity, stream or not: the real adapter
set and registry, a fake for vLLM's LoRA loader, the real :class:`ReplicaServer` and
:class:`Dispatcher`, no Ray.

The scene of each test: one adapter slot (``max_adapters_per_replica: 1``), an adapter whose
requests never leave it idle, and another adapter's request asking for the slot.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

from serve_app.common.failures import Failure
from serve_app.common.paths import DEFAULT_MODEL_NAME, REPO_ROOT
from serve_app.common.wire import Accepted, GenerateRequest, Head
from serve_app.admission.variant_queue import VariantAdmission
from serve_app.dispatch.dispatcher import Dispatcher
from serve_app.server.lora import ADAPTER_CAPACITY, HANDOVER_SHARE, AdapterSet
from serve_app.server.serving import ReplicaServer
from tests.support.fake_engine import FakeEngine, FakeLoRAModels, noop
from tests.support.fakes import FakeRouterMetrics, plan_of, registry_of

ACME, GLOBEX = "acme-support", "globex-report"
MANIFEST = REPO_ROOT / "adapters" / "manifest.yaml"
DEMO_REFS = [(ACME, 1), (GLOBEX, 1)]
WAIT_S = 0.8  # the requests' queue_timeout_s


def one_slot() -> tuple[AdapterSet, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    adapters = AdapterSet(FakeLoRAModels(), SimpleNamespace(remove_lora=noop),
                          base_model=DEFAULT_MODEL_NAME, max_lora_rank=16,
                          on_event=lambda key, event, _: events.append((key, event)))
    return adapters, events


async def steady(adapters: AdapterSet, name: str, stop: asyncio.Event, hold_s: float,
                 served: list, overlap: int = 2) -> None:
    """``overlap`` client loops on ``name``, each request holding it ``hold_s``: their
    requests overlap, so the adapter is never idle while they run."""
    async def loop(offset: float):
        await asyncio.sleep(offset)
        while not stop.is_set():
            live = await adapters.acquire(name, wait_s=WAIT_S)
            try:
                served.append((name, asyncio.get_running_loop().time()))
                await asyncio.sleep(hold_s)
            finally:
                adapters.release(live)
    await asyncio.gather(*(loop(i * hold_s / overlap) for i in range(overlap)))


def test_a_steadily_used_adapter_hands_its_slot_over_and_gets_it_back():
    """Before hand-over, globex waited out its whole queue_timeout_s behind acme's loops
    (503 adapter_capacity, again and again). Now acme hands the slot over after
    HANDOVER_SHARE of the wait, its running requests finish, and later gets it back."""
    adapters, events = one_slot()

    async def main():
        await adapters.reconcile(DEMO_REFS, MANIFEST, max_resident=1)
        stop, served = asyncio.Event(), []
        acme = asyncio.ensure_future(steady(adapters, ACME, stop, 0.1, served))
        await asyncio.sleep(0.2)  # acme holds the slot, never idle
        loop = asyncio.get_running_loop()
        asked = loop.time()
        globex = await adapters.acquire(GLOBEX, wait_s=WAIT_S)
        waited = loop.time() - asked
        resident = adapters.resident_names()
        adapters.release(globex)
        await asyncio.sleep(0.5)  # acme's waiting requests get the slot back
        stop.set()
        await acme
        return waited, resident, served, asked

    waited, resident, served, asked = asyncio.run(main())
    assert HANDOVER_SHARE * WAIT_S <= waited < WAIT_S
    assert resident == [f"{GLOBEX}@v1"]  # acme left once its running requests had ended
    assert (f"{ACME}@v1", "handover") in events
    assert any(name == ACME and at > asked + waited for name, at in served)  # acme came back


def test_each_of_two_steady_adapters_is_served_with_no_wait_past_its_bound():
    """Two adapters, each with steady overlapping requests, one slot: neither starves (every
    acquire succeeds within queue_timeout_s) and both are served throughout."""
    adapters, _ = one_slot()

    async def main():
        await adapters.reconcile(DEMO_REFS, MANIFEST, max_resident=1)
        stop, served = asyncio.Event(), []
        loops = [asyncio.ensure_future(steady(adapters, name, stop, 0.05, served))
                 for name in (ACME, GLOBEX)]
        await asyncio.sleep(4 * WAIT_S)
        stop.set()
        await asyncio.gather(*loops)  # an acquire past its wait would raise 503 here
        return served

    served = asyncio.run(main())
    start = served[0][1]
    for name in (ACME, GLOBEX):
        times = [at - start for n, at in served if n == name]
        assert times and max(times) > 3 * WAIT_S, name  # served until the end, not starved


def test_a_handover_is_called_off_when_its_waiter_leaves():
    adapters, events = one_slot()

    async def main():
        await adapters.reconcile(DEMO_REFS, MANIFEST, max_resident=1)
        acme = await adapters.acquire(ACME, wait_s=WAIT_S)
        waiter = asyncio.ensure_future(adapters.acquire(GLOBEX, wait_s=WAIT_S))
        await asyncio.sleep(HANDOVER_SHARE * WAIT_S + 0.1)
        handing_over = adapters.resident_names()  # acme is handing over: not reported
        waiter.cancel()
        await asyncio.sleep(0.05)
        after = adapters.resident_names(), adapters.ready(ACME)
        adapters.release(acme)
        return handing_over, after

    handing_over, (after, ready) = asyncio.run(main())
    assert handing_over == [] and after == [f"{ACME}@v1"] and ready
    assert (f"{ACME}@v1", "evicted") not in events


def test_a_request_for_an_adapter_handing_over_waits_then_loads_it_again():
    adapters, _ = one_slot()

    async def main():
        await adapters.reconcile(DEMO_REFS, MANIFEST, max_resident=1)
        acme = await adapters.acquire(ACME, wait_s=WAIT_S)
        globex = asyncio.ensure_future(adapters.acquire(GLOBEX, wait_s=WAIT_S))
        await asyncio.sleep(HANDOVER_SHARE * WAIT_S + 0.1)
        acme_next = asyncio.ensure_future(adapters.acquire(ACME, wait_s=5 * WAIT_S))
        await asyncio.sleep(0.05)
        assert not acme_next.done()  # it does not ride on the slot being handed over
        adapters.release(acme)  # acme's last running request ends
        g = await asyncio.wait_for(globex, WAIT_S)
        resident_then = adapters.resident_names()
        adapters.release(g)
        a = await asyncio.wait_for(acme_next, 5 * WAIT_S)
        adapters.release(a)
        return resident_then, adapters.resident_names()

    assert asyncio.run(main()) == ([f"{GLOBEX}@v1"], [f"{ACME}@v1"])


class ServerHandle:
    """A DeploymentHandle whose ``generate`` runs on a :class:`ReplicaServer` in-process."""

    def __init__(self, server: ReplicaServer) -> None:
        self.server = server

    def __call__(self, application):
        def remote(request):
            return GeneratorStream(self.server.generate(request))
        return SimpleNamespace(options=lambda stream: SimpleNamespace(
            generate=SimpleNamespace(remote=remote)))


class GeneratorStream:
    def __init__(self, gen):
        self.gen = gen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.gen.__anext__()

    def cancel(self):
        pass


def test_a_stream_that_waits_for_a_slot_is_503_adapter_capacity_without_failover():
    """Before: the router's wait for the stream's head timed out with the replica's own
    adapter wait (both queue_timeout_s), so the stream failed over (a variant failure,
    counted against the arm) and got 503 no_healthy_variant. A stream is now Accepted
    before it waits, and gets the same 503 adapter_capacity as a non-stream."""
    engine = FakeEngine(Head(200, "{}"))
    adapters, _ = one_slot()
    server = ReplicaServer("smollm-v1", engine, adapters, replica="r1")

    async def main():
        await server.reconfigure({"adapters": [{"name": ACME, "version": 1},
                                               {"name": GLOBEX, "version": 1}],
                                  "max_adapters_per_replica": 1,
                                  "stream_batching_interval_ms": 0})
        held = await adapters.acquire(ACME)  # a long acme stream holds the only slot
        admission = VariantAdmission("smollm-v1")
        admission.set_capacity(4)
        dispatcher = Dispatcher(registry_of(ServerHandle(server),
                                            admissions={"smollm-v1": admission}))
        metrics, observed = FakeRouterMetrics(), []
        results = []
        for stream in (True, False):
            plan = replace(plan_of(("smollm-v1",), queue_timeout_s=WAIT_S),
                           request=GenerateRequest("chat", {"model": f"smollm:{GLOBEX}",
                                                            "messages": [], "stream": stream},
                                                   queue_timeout_s=WAIT_S))
            account = metrics.account(lambda arms, **kw: observed.append(arms))
            account.labelled(account.tags, plan.arms)
            results.append(await dispatcher.dispatch(plan, account))
        adapters.release(held)
        return results, metrics, observed

    results, metrics, observed = asyncio.run(main())
    for response in results:
        assert response.status_code == 503
        assert json.loads(response.body)["error"]["code"] == ADAPTER_CAPACITY
        assert int(response.headers["retry-after"]) > 0
    assert metrics.failovers == [] and observed == []  # no variant failure, no arm blamed
    assert [kind for *_, kind in metrics.recorded] == [ADAPTER_CAPACITY] * 2


def test_the_replica_accepts_a_stream_before_it_waits_for_its_adapter():
    engine = FakeEngine(Head(200, "{}"))
    adapters, _ = one_slot()
    server = ReplicaServer("smollm-v1", engine, adapters, replica="r1")

    async def main():
        await server.reconfigure({"adapters": [{"name": ACME, "version": 1},
                                               {"name": GLOBEX, "version": 1}],
                                  "max_adapters_per_replica": 1,
                                  "stream_batching_interval_ms": 0})
        held = await adapters.acquire(ACME)
        items = [i async for i in server.generate(GenerateRequest(
            "chat", {"model": f"smollm:{GLOBEX}", "messages": [], "stream": True},
            queue_timeout_s=0.2))]
        adapters.release(held)
        return items

    first, head = asyncio.run(main())
    assert isinstance(first, Accepted)
    assert (head.status, head.failure) == (503, Failure.CAPACITY)
