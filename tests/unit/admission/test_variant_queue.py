"""Unit tests of admission control (pure asyncio, no Ray): slots, priority order, reserved
slots, rejection at arrival, deadlines, shedding."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.admission.variant_queue import ADMIT_MARGIN, VariantAdmission
from serve_app.admission.fair_share import service_cost
from serve_app.admission.service_time import PRIOR_SERVICE_S
from serve_app.admission.refusals import Rejected
from serve_app.admission.slots import Counted
from tests.support.clocks import FakeClock


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
        assert q.service_time.s == PRIOR_SERVICE_S == 2.0
        held = [await q.acquire(0, True) for _ in range(2)]
        # Each queued request adds service_s / slots = 1 s of wait: 9 fit in ADMIT_MARGIN
        # (0.9) x 10 s.
        fit = round(ADMIT_MARGIN * 10)
        queued = [asyncio.create_task(q.acquire(0, True)) for _ in range(fit)]
        await asyncio.sleep(0)
        assert q.queued == fit == 9
        with pytest.raises(Rejected) as e:
            await q.acquire(0, True)
        assert e.value.reason == "overloaded" and 1 <= e.value.retry_after_s <= 10
        assert "would wait about 10 s" in e.value.message
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
        q.service_time.s = 0.001  # the estimate says it fits; the deadline still holds
        held = await q.acquire(0, True)
        with pytest.raises(Rejected) as e:
            await q.acquire(0, True)
        assert e.value.reason == "queue_timeout" and q.queued == 0
        q.release(held)
        assert q.in_flight == 0
    run(main())


def test_better_priority_sheds_worse_requests_it_pushes_past_their_deadline():
    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=3.75, clock=clock)
        q.set_capacity(1)
        q.service_time.s = 1.0
        held = await q.acquire(0, True)
        # Waits 1, 2, 3 s: within ADMIT_MARGIN (0.9) x 3.75 s; the deadline is 3.75 s.
        lows = [asyncio.create_task(q.acquire(5, False)) for _ in range(3)]
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


def test_service_time_is_learned_while_full_and_starts_from_the_replicas_measure():
    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, clock=clock, queue_timeout_s=30)
        q.set_capacity(2, full_batch_service_s=3.0)  # what the replicas measured at start-up
        assert q.service_time.s == 3.0 and q.max_queued == 20  # 30 s x 2 slots / 3 s
        for _ in range(30):  # one at a time: the variant is never full, nothing learned
            slot = await q.acquire(0, True)
            clock.advance(0.5)
            q.release(slot, size=1.0)
        assert q.service_time.s == 3.0
        for _ in range(30):  # two at a time: full
            a, b = await q.acquire(0, True), await q.acquire(0, True)
            clock.advance(4.0)
            q.release(a, size=1.0)
            q.release(b, size=1.0)
        assert q.service_time.s == pytest.approx(4.0, abs=0.05)
        q.set_capacity(4, full_batch_service_s=3.0)  # learned beats the start-up measure
        assert q.service_time.s == pytest.approx(4.0, abs=0.05) and q.max_queued in (30, 31)
    run(main())


def test_slower_service_sheds_queued_requests_before_their_deadline():
    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=40, clock=clock)
        q.set_capacity(1)
        q.service_time.s = 1.0
        held = await q.acquire(0, True)
        queued = [asyncio.create_task(q.acquire(0, True)) for _ in range(4)]  # 1..4 s
        await settle()
        assert q.queued == 4
        clock.advance(15)  # the running request took 15 s, the first sample while full: it
        q.release(held, size=1.0)  # replaces the prior (1 s) at once: service_s is 15 s
        await settle()
        # The first queued request got the slot; the others would start 15, 30, 45 s from
        # now (t = 30, 45, 60): the two past their deadline (t = 40) are shed.
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


def test_token_fair_order_serves_the_tenant_with_less_service_first_and_fifo_does_not():
    """One slot; a heavy tenant has 4 requests queued before a light one's 2. With
    ``fairness: tokens`` the light tenant's requests start as soon as its counter is the
    least; with ``fifo`` they wait behind all of the heavy's."""
    async def order_of(fairness: str) -> list[str]:
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100,
                             fairness=fairness)
        q.set_capacity(1)
        running = await q.acquire(0, False, "heavy")
        q.served(running, 300)  # a stream: its tokens so far, as relayed
        started: list[str] = []

        async def one(name: str, tenant: str, cost: float):
            slot = await q.acquire(0, False, tenant)
            started.append(name)
            await asyncio.sleep(0)
            q.release(slot, cost)

        tasks = [asyncio.create_task(one(f"heavy-{i}", "heavy", 300)) for i in range(4)]
        await settle()
        tasks += [asyncio.create_task(one(f"light-{i}", "light", 30)) for i in range(2)]
        await settle()
        q.release(running, 300)
        await asyncio.gather(*tasks)
        return started

    assert run(order_of("fifo")) == ["heavy-0", "heavy-1", "heavy-2", "heavy-3",
                                     "light-0", "light-1"]
    # The light tenant arrives lifted to the heavy's counter (300: what its running stream
    # was served; no credit for having been idle). The tie goes to the earlier arrival, then
    # every heavy request served adds 300 and every light one 30.
    assert run(order_of("tokens")) == ["heavy-0", "light-0", "light-1", "heavy-1",
                                       "heavy-2", "heavy-3"]


def test_priority_still_goes_first_under_token_fairness():
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100)
        q.set_capacity(1)
        q.service["cheap"] = 0.0
        running = await q.acquire(0, False, "x")
        started = []

        async def one(name, priority, tenant):
            slot = await q.acquire(priority, False, tenant)
            started.append(name)
            q.release(slot)
        tasks = [asyncio.create_task(one("worse-priority-less-service", 5, "cheap")),
                 asyncio.create_task(one("better-priority", 0, "busy"))]
        q.service["busy"] = 1e9
        await settle()
        q.release(running)
        await asyncio.gather(*tasks)
        assert started == ["better-priority", "worse-priority-less-service"]
    run(main())


def test_a_tenant_back_from_idle_gets_no_burst_of_credit_and_usage_corrects_the_count():
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100)
        q.set_capacity(1)
        running = await q.acquire(0, False, "busy")
        assert q.service == {"busy": 0}  # nothing served yet: nothing counted
        q.served(running, 100)  # its stream so far
        assert q.service == {"busy": 100}
        queued = asyncio.create_task(q.acquire(0, False, "busy"))
        await settle()
        q.service["idle"] = 10.0  # it was served long ago
        late = asyncio.create_task(q.acquire(0, False, "idle"))
        await settle()
        assert q.service["idle"] == 100.0  # lifted to the least counter of service
        q.release(running, cost=40)  # vLLM's usage says 40: it replaces the 100 counted
        await settle()
        assert q.service["busy"] == 40
        assert queued.done() and not late.done()  # 40 < 100: busy's next goes first
        q.release(queued.result(), cost=0)  # ended before it ran: served nothing
        await settle()
        assert q.service["busy"] == 40 and late.done()
        q.release(late.result())
    run(main())


def test_no_credit_for_idle_time_even_when_nothing_is_queued():
    """A tenant that has only running requests still sets the floor a returning tenant is
    lifted to."""
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100)
        q.set_capacity(2)
        running = await q.acquire(0, False, "busy")
        q.served(running, 500)
        q.service["idle"] = 3.0
        mine = await q.acquire(0, False, "idle")
        assert q.service["idle"] == 500  # lifted to busy's 500; starting charges nothing
        q.release(running)
        q.release(mine)
    run(main())


def test_on_an_idle_variant_past_service_is_forgotten():
    """A tenant served a lot earlier and one that was away meet on an idle variant: the one
    that arrives first is lifted to the greatest counter, so the other, arriving second,
    does not wait behind a debt from before."""
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100)
        q.set_capacity(1)
        q.service.update({"was-busy": 25_000.0, "was-away": 0.0})
        heavy = await q.acquire(0, False, "was-away")
        assert q.service["was-away"] == 25_000
        queued = [asyncio.create_task(q.acquire(0, False, "was-away")) for _ in range(3)]
        light = asyncio.create_task(q.acquire(0, False, "was-busy"))
        await settle()
        assert q.service["was-busy"] == 25_000  # no debt from before: the greatest counter
        q.release(heavy, cost=190)
        await settle()
        # The heavy one was served 190 more than the light one: the light one goes next.
        assert light.done() and not any(t.done() for t in queued)
        q.release(light.result(), cost=70)
        for t in queued:
            await settle()
            q.release(await t, cost=190)
    run(main())


def test_a_tenant_with_requests_in_flight_leaves_a_newcomer_an_engine_slot():
    async def main():
        q = VariantAdmission("v", headroom=0.25, queue_timeout_s=300, newcomer_slots=1)
        q.set_capacity(4, full_batch_service_s=1.0)  # 4 engine slots, 5 with the headroom
        heavy = [await q.acquire(0, True, "heavy")]  # its first: any free slot
        heavy += [await q.acquire(0, True, "heavy") for _ in range(2)]
        assert q.in_flight == 3
        queued = asyncio.create_task(q.acquire(0, True, "heavy"))  # 4th: held back
        await settle()
        assert not queued.done() and q.queued == 1
        light = await asyncio.wait_for(q.acquire(0, True, "light"), 1)  # starts at once
        assert q.in_flight == 4 and not queued.done()
        q.release(light, cost=1.0)
        await settle()
        assert not queued.done()  # the free slot is still the newcomers'
        q.release(heavy.pop(), cost=100.0)
        await settle()
        assert queued.done() and q.in_flight == 3
        # Without tenants (open mode) and with fifo, nothing is held back.
        for fairness, tenant in (("tokens", ""), ("fifo", "heavy")):
            q = VariantAdmission("v", headroom=0, newcomer_slots=1, fairness=fairness)
            q.set_capacity(2)
            await q.acquire(0, True, tenant)
            await asyncio.wait_for(q.acquire(0, True, tenant), 1)
            assert q.in_flight == 2
    run(main())


def test_a_tenant_under_an_equal_share_of_the_slots_may_take_the_newcomer_slots():
    """The newcomer slots are for any tenant holding less than an equal share of the slots
    (among the tenants in flight and one more), not only for one with nothing in flight: a
    light tenant with requests running still starts at once beside a heavy tenant that
    holds the busy tenants' share, and a heavy one never takes them."""
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, newcomer_slots=4)
        q.set_capacity(12, full_batch_service_s=1.0)  # 8 for the busy tenants
        heavy = [await q.acquire(0, True, "heavy") for _ in range(7)]
        light = [await q.acquire(0, True, "light")]  # 8 in flight: the busy share is full
        assert q.in_flight == 8 and not light[0].newcomer
        more_heavy = asyncio.create_task(q.acquire(0, True, "heavy"))  # 7 x 3 >= 12: busy
        await settle()
        assert not more_heavy.done()
        # light: 1, 2, then 3 in flight; 3 x (2 tenants + 1) < 12: newcomer slots, at once
        for n in range(3):
            light.append(await asyncio.wait_for(q.acquire(0, True, "light"), 1))
            assert light[-1].newcomer
        # 4 x 3 = 12: an equal share, busy now; the newcomer slots are full anyway
        assert q.in_flight == 11 and q.shares.busy("light", q.capacity)
        late = asyncio.create_task(q.acquire(0, True, "light"))
        await settle()
        assert not late.done() and not more_heavy.done()
        # A light request in a newcomer slot ends: its slot is for newcomers again, and the
        # busy heavy tenant still waits.
        q.release(light.pop(), cost=1.0)
        await settle()
        assert not more_heavy.done() and late.done() and late.result().newcomer
        more_heavy.cancel()
    run(main())


def test_a_tenant_that_turns_busy_counts_its_newcomer_slots_against_its_share():
    """A tenant that took newcomer slots while under an equal share counts them once it is
    busy: it takes no more while it holds the busy share in all, and the slots its busy
    neighbour frees go to a real newcomer (else it could hold every engine slot)."""
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, newcomer_slots=2)
        q.set_capacity(8, full_batch_service_s=1.0)  # 6 for the busy tenants
        a = [await q.acquire(0, True, "a") for _ in range(6)]
        b = [await asyncio.wait_for(q.acquire(0, True, "b"), 1) for _ in range(2)]
        assert all(s.newcomer for s in b) and q.in_flight == 8
        more_b = [asyncio.create_task(q.acquire(0, True, "b")) for _ in range(3)]
        await settle()
        q.release(a.pop(), cost=100.0)  # b (less served, 2 x 3 < 8: a newcomer) takes it
        await settle()
        assert sum(t.done() for t in more_b) == 1 and q.shares.busy("b", 8)  # 3 x 3 >= 8
        q.release(a.pop(), cost=100.0)  # b holds 3 (2 in newcomer slots): its busy share
        await settle()
        assert sum(t.done() for t in more_b) == 1 and q.in_flight == 7
        c = await asyncio.wait_for(q.acquire(0, True, "c"), 1)  # the free slot is c's
        assert q.in_flight == 8 and c.tenant == "c"
        for t in more_b:
            t.cancel()
    run(main())


def test_a_newcomers_burst_is_refused_at_arrival_past_what_can_start_in_time():
    """Only as many of a newcomer's queued requests as there are free newcomer slots count
    as starting at once in the wait estimate: a light tenant (1 of 8 slots, a newcomer)
    sending a burst is refused at arrival once the rest could not start in time, as a busy
    tenant is (0.9 x 30 s x 8 slots / 1 s a request: 216 wait)."""
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=30, newcomer_slots=1)
        q.set_capacity(8, full_batch_service_s=1.0)
        for _ in range(7):
            await q.acquire(0, True, "heavy")
        await q.acquire(0, True, "light")  # in the newcomer slot
        queued = 0
        with pytest.raises(Rejected) as refused:
            for _ in range(1000):
                q.enter(0, True, "light")
                queued += 1
        assert refused.value.reason == "overloaded" and queued == 216, queued
    run(main())


def test_a_newcomer_in_its_slot_leaves_the_busy_tenants_theirs():
    """A newcomer's request runs in the slot kept for newcomers, not in the busy tenants'
    share: a heavy request that ends meanwhile gives its slot to the heavy tenant's next,
    and the engine stays full (before, the heavy tenant fell to capacity - 2 while a
    newcomer ran, and one engine slot idled)."""
    async def main():
        q = VariantAdmission("v", headroom=0.25, queue_timeout_s=300, newcomer_slots=1)
        q.set_capacity(4, full_batch_service_s=1.0)
        heavy = [await q.acquire(0, True, "heavy") for _ in range(3)]
        queued = asyncio.create_task(q.acquire(0, True, "heavy"))
        await settle()
        light = await asyncio.wait_for(q.acquire(0, True, "light"), 1)
        assert q.in_flight == 4 and not queued.done()
        q.release(heavy.pop(), cost=100.0)
        await settle()
        assert queued.done() and q.in_flight == 4  # the engine stays full
        q.release(light, cost=1.0)
        nxt = asyncio.create_task(q.acquire(0, True, "heavy"))
        await settle()
        assert q.in_flight == 3 and not nxt.done()  # the newcomers' slot stays theirs
        nxt.cancel()
    run(main())


def test_a_freed_slot_stays_its_less_served_tenants_for_anticipation_s():
    """A light tenant that sends its next request as its last one ends keeps its slot
    (anticipation_s), instead of losing it to the heavy tenant's queue; a tenant that does
    not come back holds it only that long, and one served more than those waiting keeps
    nothing."""
    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, newcomer_slots=0,
                             anticipation_s=0.05, clock=clock)
        q.set_capacity(5, full_batch_service_s=1.0)
        heavy = [await q.acquire(0, True, "heavy") for _ in range(2)]
        for slot in heavy:
            q.served(slot, 100.0)  # two streams, 100 each so far
        light = [await q.acquire(0, True, "light")]  # lifted to the heavy one's 200
        heavy.append(await q.acquire(0, True, "heavy"))
        q.served(heavy[-1], 100.0)  # 300: ahead of it now
        light.append(await q.acquire(0, True, "light"))
        waiting = asyncio.create_task(q.acquire(0, True, "heavy"))
        await settle()
        q.release(light.pop(), cost=1.0, size=1.0)
        await settle()
        assert not waiting.done()  # the slot is the light tenant's for 50 ms
        light.append(await asyncio.wait_for(q.acquire(0, True, "light"), 1))
        assert q.in_flight == 5 and not waiting.done()
        q.release(light.pop(), cost=1.0, size=1.0)  # this time its client does not come back
        await asyncio.sleep(0.06)  # the timer gives the slot to the queue (the test's clock
        # stands still: the timer ends the keep whatever the clocks say)
        assert waiting.done() and q.in_flight == 5
        heavy.append(waiting.result())
        # The heavy tenant, served more than the light one waiting, keeps nothing.
        late = asyncio.create_task(q.acquire(0, True, "light"))
        await settle()
        q.release(heavy.pop(), cost=100.0, size=1.0)
        await settle()
        assert late.done()
        # Served less than one tenant waiting but more than another: nothing is kept, the
        # least served goes next.
        q.release(heavy.pop(), cost=100.0, size=1.0)  # nobody waits: nothing kept
        new = await q.acquire(0, True, "new")  # 5 in flight
        q.service["new"] = 50.0  # served least of all
        more_heavy = asyncio.create_task(q.acquire(0, True, "heavy"))
        more_new = asyncio.create_task(q.acquire(0, True, "new"))
        await settle()
        assert not more_heavy.done() and not more_new.done() and new.tenant == "new"
        q.release(light.pop(), cost=1.0, size=1.0)  # light: above new, below heavy
        await settle()
        assert more_new.done() and not more_heavy.done()
    run(main())


def test_a_light_tenants_freed_slot_is_kept_for_it_beside_the_newcomer_slots():
    """Anticipation with newcomer slots: a light tenant (a newcomer: under an equal share)
    with one request in the newcomer slot and one in a busy tenant's freed slot keeps that
    slot, when its request there ends, for its next one, while the busy heavy tenant waits
    (without anticipation_s the heavy tenant takes it)."""
    for anticipation_s, kept in ((0.05, True), (0.0, False)):
        async def main():
            q = VariantAdmission("v", headroom=0, queue_timeout_s=300, newcomer_slots=1,
                                 anticipation_s=anticipation_s, clock=FakeClock())
            q.set_capacity(6, full_batch_service_s=1.0)  # 5 for the busy tenants
            heavy = [await q.acquire(0, True, "heavy") for _ in range(5)]
            for slot in heavy:
                q.served(slot, 100.0)
            first = await asyncio.wait_for(q.acquire(0, True, "light"), 1)  # lifted to 500
            assert first.newcomer and q.in_flight == 6
            for slot in heavy:
                q.served(slot, 100.0)  # the heavy streams run on: 1,000
            second = asyncio.create_task(q.acquire(0, True, "light"))
            waiting = asyncio.create_task(q.acquire(0, True, "heavy"))
            await settle()
            q.release(heavy.pop(), cost=100.0, size=1.0)  # the light tenant, less served,
            await settle()  # takes it
            assert second.done() and not second.result().newcomer and not waiting.done()
            q.release(second.result(), cost=10.0, size=1.0)
            await settle()
            assert waiting.done() is not kept
            if kept:
                await asyncio.wait_for(q.acquire(0, True, "light"), 1)  # its next: at once
                assert q.in_flight == 6 and not waiting.done()
                waiting.cancel()
        run(main())


def test_a_longer_request_counts_for_its_tokens_in_the_wait_estimate():
    from serve_app.admission.service_time import request_size

    assert request_size(16) == 1.0 and request_size(64) == 3.0  # (64 + 8) / (16 + 8)

    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=12.5, clock=clock)  # admits 10 s
        q.set_capacity(1, full_batch_service_s=1.0)  # a 16-token request: 1 s while full
        held = await q.acquire(0, True, size=3.0)
        long = [asyncio.create_task(q.acquire(0, True, size=3.0)) for _ in range(3)]  # 9 s
        await settle()
        assert q.queued == 3
        with pytest.raises(Rejected) as refused:  # 9 + 3 = 12 s > 10 s
            await q.acquire(0, True, size=3.0)
        assert refused.value.reason == "overloaded"
        short = asyncio.create_task(q.acquire(0, True, size=1.0))  # 9 + 1 = 10 s: fits
        await settle()
        assert q.queued == 4 and not short.done()
        # Learned while full, per unit of size: 6 s for a 3-unit request is 2 s per unit
        # (the first sample replaces the start-up measure).
        clock.advance(6)
        q.release(held, size=3.0)
        assert q.service_time.s == pytest.approx(2.0)
        for t in long + [short]:
            t.cancel()
        await asyncio.gather(*long, short, return_exceptions=True)
    run(main())


def test_a_poisoners_reservation_cannot_push_another_tenant_back():
    """Issue 27: a poisoner streams requests of ``max_tokens: 1e9`` (a whole context
    reserved) that stop after one token. Counters move by what was served, so a tenant that
    arrives while one runs is lifted to the poisoner's service (a few tokens), not to its
    reservation, and goes ahead of the poisoner's next request once the first has been
    counted. (Charged their reservation at the start, as before, the honest tenant was lifted
    to about a context's worth, 4,100 weighted tokens, and then served behind the poisoner
    until that much more was served to the poisoner.)"""
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100)
        q.set_capacity(1)
        poison = await q.acquire(0, False, "poisoner")  # it reserved a whole context
        q.served(poison, service_cost(0, 1))  # its one token, relayed
        honest = asyncio.create_task(q.acquire(0, False, "honest"))
        await settle()
        assert q.service["honest"] == service_cost(0, 1)  # the poisoner's service so far
        again = asyncio.create_task(q.acquire(0, False, "poisoner"))
        await settle()
        q.release(poison, cost=service_cost(12, 1))  # vLLM's usage
        await settle()
        assert honest.done() and not again.done()
        q.release(honest.result(), cost=service_cost(12, 16))
        await settle()
        q.release(await again, cost=0)  # vLLM refused it: it was served nothing
        return dict(q.service)

    assert run(main()) == {"poisoner": service_cost(12, 1),
                           "honest": service_cost(0, 1) + service_cost(12, 16)}


def test_a_running_request_counts_its_prompt_and_a_non_stream_the_time_it_has_run():
    """A request's prompt counts when it starts (its prefill is its first step: VTC counts
    a request's input when it joins the batch), so that slots granted at one moment take
    turns. A non-stream's answer comes whole at its end: while it runs, its completion
    counts at the variant's rate (``ServiceTime.tokens_per_s``, from ``service_s``) up to
    its ``max_tokens``, so a tenant arriving meanwhile is lifted to what it has been served
    so far (else its whole run would be credit for the newcomer). Its usage replaces both
    at the end."""
    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100,
                             clock=clock)
        q.set_capacity(2, full_batch_service_s=1.0)  # a request of size 1 a second
        per_s = service_cost(0, q.service_time.tokens_per_s())
        busy = await q.acquire(0, False, "busy",
                               counts=Counted(service_cost(30, 0), service_cost(0, 100)))
        assert q.shares.served_so_far("busy") == 30  # its prompt (at its bound)
        clock.now = 2.0
        assert q.shares.served_so_far("busy") == pytest.approx(30 + 2 * per_s)
        clock.now = 60.0
        assert q.shares.served_so_far("busy") == 30 + service_cost(0, 100)  # max_tokens
        late = await q.acquire(0, False, "late")
        assert q.service["late"] == 30 + service_cost(0, 100)  # lifted to it
        q.release(busy, cost=service_cost(10, 60))  # vLLM's usage replaces the estimate
        assert q.shares.served_so_far("busy") == service_cost(10, 60)
        # Its client left (no usage: cost None): what its prompt and time counted stands.
        left = await q.acquire(0, False, "busy",
                               counts=Counted(service_cost(30, 0), service_cost(0, 100)))
        at_start = q.shares.served_so_far("busy")  # lifted to late's, and its prompt
        clock.now = 61.0
        q.release(left)
        assert q.shares.served_so_far("busy") == pytest.approx(at_start + per_s)
        q.release(late)
    run(main())


def test_a_held_request_is_not_shed_when_the_warm_engine_is_slower_than_measured():
    """A cold start holds what its first replica can start within queue_timeout_s by the
    start-up measure. When the warm engine proves slower (here 4 s a request, not 1 s), the
    held requests keep their places until their cold_start_timeout_s would have ended: a held
    stream has had its 200 and must not be shed in-band (full20's herd: 6 of 46 were)."""
    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=2, clock=clock)
        q.set_capacity(0, full_batch_service_s=1.0)
        q.expect_start(2)  # 2 + 0.9 x 2 s x 2 / 1 s = 5.6: five of size 1 held
        tickets = [q.enter(0, True, hold_s=60) for _ in range(5)]
        with pytest.raises(Rejected):
            q.enter(0, True, hold_s=60)
        held = [asyncio.create_task(q.wait(t)) for t in tickets]
        clock.advance(5)  # the replica is warm 5 s later
        q.set_capacity(2, full_batch_service_s=1.0)
        await settle()
        assert [t.done() for t in held] == [True, True, False, False, False]
        clock.advance(4)  # the first request took 4 s while the variant was full: at 4 s each,
        q.release(held[0].result(), size=1.0)  # the last two would start past warm + 2 s
        await settle()
        assert [t.done() for t in held] == [True, True, True, False, False]  # none shed
        assert not any(t.exception() for t in held if t.done())
        # A request that came after the start is admitted by the slower measure: not now.
        with pytest.raises(Rejected) as e:
            await q.acquire(0, True)
        assert e.value.reason == "overloaded"
        for i in (1, 2, 3):
            q.release(held[i].result(), size=1.0)
            await settle()
        q.release((await held[4]), size=1.0)
        assert q.in_flight == 0
    run(main())


def test_a_routes_headroom_sets_the_best_prioritys_slots_beyond_the_engines():
    """``admission.headroom``: the best priority may have capacity x (1 + headroom) in
    flight (the rest waits inside vLLM); the others keep ``reserved_slots`` free. A
    configure that names no headroom keeps the one set."""
    from serve_app.common.policies import Admission

    q = VariantAdmission("v")
    q.set_capacity(8)
    assert q.slots_for(True) == 10  # the default, 0.25
    q.configure(**Admission(headroom=1.0).model_dump())
    assert q.slots_for(True) == 16 and q.slots_for(False) == 7
    q.configure(queue_timeout_s=30, reserved_slots=1, max_queued_per_slot=None)
    assert q.slots_for(True) == 16
    with pytest.raises(ValueError):
        Admission(headroom=11)
