"""Unit tests of admission control (pure asyncio, no Ray): slots, priority order, reserved
slots, rejection at arrival, deadlines, shedding."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.ingress.admission import PRIOR_SERVICE_S, Rejected, VariantAdmission


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    """Let every task that can run, run."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_unknown_capacity_admits_and_zero_capacity_is_unavailable():
    async def main():
        q = VariantAdmission("v", headroom=0)
        slots = [await q.acquire(0, True) for _ in range(50)]  # not learned yet: no bound
        assert q.in_flight == 50
        for s in slots:
            q.release(s)
        q.set_capacity(0)
        with pytest.raises(Rejected) as e:
            await q.acquire(0, True)
        assert e.value.reason == "unavailable"
    run(main())


def test_queued_requests_start_in_priority_order_then_fifo():
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=30)
        q.set_capacity(1)
        running = await q.acquire(5, False)
        order = []

        async def wait(name, priority):
            slot = await q.acquire(priority, False)
            order.append(name)
            q.release(slot)

        tasks = [asyncio.create_task(wait(n, p)) for n, p in
                 (("low-1", 5), ("high-1", 0), ("low-2", 5), ("high-2", 0))]
        await asyncio.sleep(0)
        assert q.queued == 4
        q.release(running)
        await asyncio.gather(*tasks)
        assert order == ["high-1", "high-2", "low-1", "low-2"]
    run(main())


def test_reserved_slots_are_for_the_best_priority_only():
    async def main():
        q = VariantAdmission("v", headroom=0, reserved_slots=1)
        q.set_capacity(3)
        low = [await q.acquire(5, False), await q.acquire(5, False)]
        # A third low-priority request must wait: the last slot is reserved...
        waiting = asyncio.create_task(q.acquire(5, False))
        await asyncio.sleep(0)
        assert not waiting.done() and q.in_flight == 2
        # ...for the best priority, which starts at once.
        top = await q.acquire(0, True)
        assert q.in_flight == 3
        q.release(top)
        await asyncio.sleep(0)
        assert not waiting.done()  # the freed slot is still the reserved one
        q.release(low[0])
        third = await waiting
        assert q.in_flight == 2
        for s in (third, low[1]):
            q.release(s)
        assert q.in_flight == 0
    run(main())


def test_rejected_at_arrival_when_the_estimated_wait_exceeds_the_timeout():
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=10, max_queued_per_slot=100)
        q.set_capacity(2)
        assert q.service_s == PRIOR_SERVICE_S == 2.0
        held = [await q.acquire(0, True) for _ in range(2)]
        # Each queued request adds service_s / slots = 1 s of wait: 10 fit in 10 s.
        queued = [asyncio.create_task(q.acquire(0, True)) for _ in range(10)]
        await asyncio.sleep(0)
        assert q.queued == 10
        with pytest.raises(Rejected) as e:
            await q.acquire(0, True)
        assert e.value.reason == "overloaded" and 1 <= e.value.retry_after_s <= 10
        assert "would wait about 11 s" in e.value.message
        for t in queued:
            t.cancel()
        for s in held:
            q.release(s)
    run(main())


def test_max_queued_bounds_the_queue():
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=600, max_queued_per_slot=2)
        q.set_capacity(1)
        held = await q.acquire(0, True)
        queued = [asyncio.create_task(q.acquire(0, True)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Rejected) as e:
            await q.acquire(0, True)
        assert e.value.reason == "overloaded"
        for t in queued:
            t.cancel()
        q.release(held)
    run(main())


def test_queue_deadline_rejects_before_anything_is_sent():
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=0.05)
        q.set_capacity(1)
        q.service_s = 0.001  # the estimate says it fits; the deadline still holds
        held = await q.acquire(0, True)
        with pytest.raises(Rejected) as e:
            await q.acquire(0, True)
        assert e.value.reason == "queue_timeout" and q.queued == 0
        q.release(held)
        assert q.in_flight == 0
    run(main())


def test_better_priority_sheds_worse_requests_it_pushes_past_their_deadline():
    async def main():
        clock = Clock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=3, clock=clock)
        q.set_capacity(1)
        q.service_s = 1.0
        held = await q.acquire(0, True)
        lows = [asyncio.create_task(q.acquire(5, False)) for _ in range(3)]  # waits 1, 2, 3 s
        await asyncio.sleep(0)
        assert q.queued == 3
        high = asyncio.create_task(q.acquire(0, True))  # goes first: the last low is at 4 s
        await settle()
        shed = [t for t in lows if t.done()]
        assert len(shed) == 1 and shed[0] is lows[2]
        assert isinstance(shed[0].exception(), Rejected) and shed[0].exception().reason == "shed"
        q.release(held)
        slot = await high
        q.release(slot)
        for t in lows[:2]:
            q.release(await t)
        assert q.in_flight == 0
    run(main())


def test_client_leaving_while_queued_frees_its_place():
    async def main():
        q = VariantAdmission("v", headroom=0)
        q.set_capacity(1)
        held = await q.acquire(0, True)
        waiting = asyncio.create_task(q.acquire(0, True))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert q.queued == 0
        q.release(held)
        q.release(held)  # a second release does nothing
        assert q.in_flight == 0
    run(main())


def test_service_time_is_learned():
    async def main():
        clock = Clock()
        q = VariantAdmission("v", headroom=0, clock=clock)
        q.set_capacity(4)
        for _ in range(30):
            slot = await q.acquire(0, True)
            clock.t += 0.5
            q.release(slot)
        assert q.service_s == pytest.approx(0.5, abs=0.01)
    run(main())


def test_slower_service_sheds_queued_requests_before_their_deadline():
    async def main():
        clock = Clock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=40, clock=clock)
        q.set_capacity(1)
        q.service_s = 1.0
        held = await q.acquire(0, True)
        queued = [asyncio.create_task(q.acquire(0, True)) for _ in range(4)]  # 1..4 s
        await settle()
        assert q.queued == 4
        clock.t += 30  # the running request took 30 s: service_s becomes 0.8 + 6 = 6.8 s
        q.release(held)
        await settle()
        # The first queued request got the slot; the others would start 6.8, 13.6, 20.4 s
        # from now (t = 36.8, 43.6, 50.4): the two past their deadline (t = 40) are shed.
        outcomes = [t.exception().reason if t.done() and t.exception() else
                    ("granted" if t.done() else "waiting") for t in queued]
        assert outcomes == ["granted", "waiting", "shed", "shed"], outcomes
        q.release(queued[0].result())
        q.release(await queued[1])
        assert q.in_flight == 0
    run(main())


def test_the_best_priority_gets_headroom_beyond_the_engines_capacity():
    async def main():
        q = VariantAdmission("v", reserved_slots=1)  # default headroom: 25 %
        q.set_capacity(8)
        assert (q.slots_for(True), q.slots_for(False)) == (10, 7)
        slots = [await q.acquire(0, True) for _ in range(10)]  # 8 run, 2 wait inside vLLM
        assert q.in_flight == 10
        for s in slots:
            q.release(s)
    run(main())
