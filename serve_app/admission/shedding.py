"""What a variant's queue (:mod:`serve_app.admission.variant_queue`) waits for, and which
queued requests can no longer start in time: functions over its
:class:`~serve_app.admission.fair_queue.FairQueue`.

Work is counted in ``request_size`` units (:mod:`serve_app.admission.service_time`); times
are seconds on admission's clock. A queued request that would start in a free newcomer slot
(:meth:`~serve_app.admission.fair_share.FairShare.fits_newcomer_slot`) adds nothing to the
wait of a busy tenant's request behind it, which may not use that slot: the estimates
(:func:`work_ahead`, :func:`shed_late`) leave it out.

Shedding refuses, worst priority first to go, the queued requests whose estimated start is
past their deadline: when service gets slower, and when a better-ranked request arrives
ahead of them (:func:`pushes_back`). The order is walked by ranks (priority, the tenant's
counter); a rank is passed whole when even its last request would start by its earliest
deadline, so a decision costs about the tenants queued, not the requests.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from serve_app.admission.fair_queue import FairQueue, Group
from serve_app.admission.service_time import ServiceTime
from serve_app.admission.slots import Waiter

#: A tenant's place in the order within a priority (its service with ``fairness: tokens``),
#: read once per tenant for one decision.
Counter = Callable[[str], float]


def queued_ahead(queue: FairQueue, priority: int, tenant: str, counter: Counter
                 ) -> tuple[list[Group], list[Waiter]]:
    """The groups and the held requests of ``queue`` that a new request of ``tenant`` at
    ``priority`` would queue behind: those of its rank (priority, counter) or a better one
    (it goes last of its rank)."""
    rank = (priority, counter(tenant))
    return ([g for g in queue.groups if (g.priority, counter(g.tenant)) <= rank],
            [w for w in queue.held if (w.priority, counter(w.tenant)) <= rank])


def newcomer_slot_takers(groups: list[Group], held: list[Waiter], free: int,
                         fits: Callable[[str], bool]) -> list[Waiter]:
    """Of the requests queued in ``groups`` and ``held``, those that would start in the
    ``free`` newcomer slots: the first in arrival order whose tenant ``fits`` one (a
    newcomer), one a slot. They add nothing to the wait of a busy tenant's request behind
    them, which may not use those slots anyway."""
    if not free:
        return []
    fitting = [g for g in groups if fits(g.tenant)]
    fitting.append([w for w in held if fits(w.tenant)])
    return list(itertools.islice(heapq.merge(*fitting, key=lambda w: w.seq), free))


def work_ahead(groups: list[Group], held: list[Waiter], free: int,
               fits: Callable[[str], bool]) -> float:
    """The work (sizes) queued in ``groups`` and ``held`` that a request behind them waits
    for: all of it but what :func:`newcomer_slot_takers` take of the ``free`` newcomer
    slots."""
    takers = newcomer_slot_takers(groups, held, free, fits)
    return (sum(g.size for g in groups) + sum(w.size for w in held)
            - sum(w.size for w in takers))


def pushes_back(queue: FairQueue, newcomer: Waiter, counter: Counter) -> bool:
    """Whether ``newcomer`` (just queued) goes ahead of queued requests of a worse rank,
    whose start it may push past their deadline (then :func:`shed_late`)."""
    rank = (newcomer.priority, counter(newcomer.tenant))
    return any((g.priority, counter(g.tenant)) > rank for g in queue.groups)


def shed_late(queue: FairQueue, now: float, counter: Counter, service_time: ServiceTime,
              tenant_slots: Callable[[bool, str], int], fits: Callable[[str], bool],
              free: int) -> list[Waiter]:
    """Take out of ``queue`` the requests whose estimated start is past their deadline,
    worst priority first to go; the caller refuses them (``shed``), in the order returned.

    The order is walked by ranks (priority, counter): the groups of one rank (tenants whose
    counters are equal: their requests interleave by arrival) are passed whole when even
    their last request would start, at the rate of its tenant's slots, by their earliest
    deadline; else request by request, and, while deadlines follow arrival
    (:attr:`FairQueue.deadlines_in_order`), only until the rest of the rank would start by
    the next one's deadline.

    Args:
        now: the time on admission's clock, s.
        counter: each tenant's place within a priority, for this decision.
        service_time: the variant's service time (``wait_s``).
        tenant_slots: ``(top, tenant)`` -> the slots a request of that tenant may use.
        fits: whether a tenant's request may start in a free newcomer slot.
        free: newcomer slots free now.
    """
    shed = []
    in_order = queue.deadlines_in_order
    ahead = 0.0
    groups = sorted(queue.groups, key=lambda g: (g.priority, counter(g.tenant)))
    for _, rank in itertools.groupby(groups, key=lambda g: (g.priority, counter(g.tenant))):
        rank = list(rank)
        slots = {id(g): tenant_slots(g.top, g.tenant) for g in rank}
        fit = {id(g): fits(g.tenant) for g in rank}
        rest = sum(g.size for g in rank)
        if all(now + service_time.wait_s(ahead + rest, slots[id(g)]) <= g.min_deadline
               for g in rank):  # none of them is late
            takers = newcomer_slot_takers(rank, [], free, fits)
            ahead += rest - sum(w.size for w in takers)
            free -= len(takers)
            continue
        least, any_fits = min(slots.values()), any(fit.values())
        # one rank's requests interleave by arrival
        members = heapq.merge(*(zip(g, itertools.repeat(g)) for g in rank),
                              key=lambda m: m[0].seq)
        for w, g in members:
            if in_order and not (free and any_fits) and now + service_time.wait_s(
                    ahead + rest, least) <= w.deadline:
                ahead += rest  # it and all behind it start by its deadline, or theirs
                break
            rest -= w.size
            work = w.size
            if free and fit[id(g)]:
                free, work = free - 1, 0.0
            if now + service_time.wait_s(ahead + w.size, slots[id(g)]) <= w.deadline:
                ahead += work  # it stays: those behind it wait for it
            else:
                queue.leave(w)
                shed.append(w)
        for g in rank:
            g.refresh_min_deadline(in_order)
    return shed
