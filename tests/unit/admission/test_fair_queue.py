"""Unit tests of admission's queue (:mod:`serve_app.admission.fair_queue`): requests kept in
first-come groups, one per tenant and priority, so a decision looks at groups, not requests;
and the admission decisions that take its short cuts (pure asyncio, no Ray)."""

from __future__ import annotations

import asyncio

from serve_app.admission.variant_queue import VariantAdmission
from serve_app.admission.fair_queue import FairQueue
from serve_app.admission.slots import Waiter
from tests.support.clocks import FakeClock


def waiter(seq: int, tenant: str = "a", deadline: float = 10.0, size: float = 1.0,
           held: bool = False) -> Waiter:
    return Waiter(0, seq, deadline, True, None, tenant, size, held=held)


def test_a_tenants_requests_form_one_first_come_group_with_its_count_and_size():
    q = FairQueue()
    a0, b0, a1 = waiter(0, "a", size=2.0), waiter(1, "b"), waiter(2, "a", size=0.5)
    for w in (a0, b0, a1):
        q.add(w)
    group_a = next(g for g in q.groups if g.tenant == "a")
    assert len(q) == 3 and (group_a.live, group_a.size) == (2, 2.5)
    assert group_a.head() is a0 and list(group_a) == [a0, a1]
    q.leave(a0)
    q.leave(a0)  # once only: granted, then its wait ends
    assert len(q) == 2 and group_a.head() is a1 and (group_a.live, group_a.size) == (1, 0.5)
    q.leave(a1)
    assert {g.tenant for g in q.groups} == {"b"} and q.tenants() == {"b"}


def test_deadlines_out_of_arrival_order_are_noticed_until_the_queue_empties():
    q = FairQueue()
    first, second = waiter(0, deadline=30.0), waiter(1, deadline=20.0)  # a shorter timeout
    q.add(first)
    assert q.deadlines_in_order
    q.add(second)
    assert not q.deadlines_in_order
    q.leave(first)
    q.leave(second)
    assert len(q) == 0 and q.deadlines_in_order


def test_held_requests_join_their_groups_in_arrival_order_when_the_variant_is_warm():
    q = FairQueue()
    held = waiter(0, held=True)
    later = waiter(1)  # arrived after it, not held (the variant's capacity was not known)
    q.add(held)
    q.add(later)
    assert len(q) == 2 and q.held == [held] and q.tenants() == {"a"}
    q.unhold()
    (group,) = q.groups
    assert list(group) == [held, later] and not held.held and q.held == []
    assert not q.deadlines_in_order  # its deadline moved while the later one's did not


def test_tenants_with_equal_service_start_in_arrival_order():
    """Two tenants' groups with the same counter (prompts not counted here): the slots go
    by arrival across them, not group by group."""
    async def main():
        q = VariantAdmission("v", headroom=0, queue_timeout_s=300, max_queued_per_slot=100)
        q.set_capacity(1)
        running = await q.acquire(0, False, "a")
        started: list[str] = []

        async def one(name: str, tenant: str):
            slot = await q.acquire(0, False, tenant)
            started.append(name)
            await asyncio.sleep(0)
            q.release(slot, 0.0)

        tasks = []
        for name in ("a-1", "b-1", "a-2", "b-2"):
            tasks.append(asyncio.create_task(one(name, name[0])))
            await asyncio.sleep(0)
        q.release(running, 0.0)
        await asyncio.gather(*tasks)
        return started

    assert asyncio.run(main()) == ["a-1", "b-1", "a-2", "b-2"]


def test_when_service_runs_late_only_the_requests_past_their_deadline_are_shed():
    """One slot of 2 s (the replicas' measure); requests arrive every 0.5 s while the
    running one holds its slot, and two more at 15.9 s (deadline 45.9). At 16 s it ends (it
    generated nothing: the measure stays): the head starts, and the queued request k
    (k = 1..10, deadline 30 + 0.5 k) would start at 16 + 2 k, so only k = 10 (36 > 35) is
    past its deadline: the walk must reach it past requests that are all in time, shed it,
    then stop at the first late arrival (it and the one behind it start by 16 + 2 x 11 =
    38 < 45.9)."""
    async def main():
        clock = FakeClock()
        q = VariantAdmission("v", headroom=0, queue_timeout_s=30, clock=clock)
        q.set_capacity(1, full_batch_service_s=2.0)
        running = q.enter(0, True, "a")
        queued = []
        for k in range(11):  # the 12th would wait past 0.9 x 30 s: refused at arrival
            clock.now = 0.5 * k
            queued.append(q.enter(0, True, "a"))
        clock.now = 15.9
        queued += [q.enter(0, True, "a"), q.enter(0, True, "a")]  # 24 s and 26 s <= 27 s
        clock.now = 16.0
        q.release(running)
        await asyncio.sleep(0)
        outcomes = ["started" if w.future.done() and not w.future.exception() else
                    w.future.exception().reason if w.future.done() else "queued"
                    for w in queued]
        assert outcomes == ["started"] + ["queued"] * 9 + ["shed"] + ["queued"] * 2
        assert q.queued == 11 and q._queue.size == 11.0
    asyncio.run(main())
