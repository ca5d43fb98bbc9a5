"""The queue of one variant's admission (:mod:`serve_app.admission.variant_queue`), kept so that a
decision costs about the number of tenants queued, not the number of requests.

Admission orders queued requests by ``(priority, the tenant's service counter, arrival)``
(:meth:`VariantAdmission._counters`). A tenant's counter is one number for all its requests, so
the requests of one tenant at one priority always keep their arrival order among
themselves: they are kept as one first-come :class:`Group`, with its count and its sizes
summed. Then:

- the next request to start is the head of one group (O(groups));
- the work queued ahead of a new request is a sum over groups (O(groups));
- shedding walks the requests of a rank (the groups whose tenants' counters are equal) one
  by one only when a group's earliest deadline is in reach
  (:meth:`VariantAdmission._shed_late`).

Held requests (waiting for a cold start, first-come) are kept apart until the variant is
warm (:meth:`FairQueue.unhold`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from serve_app.admission.slots import Waiter


@dataclass
class Group:
    """The queued requests of one tenant at one priority (and ``top``, which follows it), in
    arrival order.

    ``live``, ``size`` and ``min_deadline`` cover the requests still queued (``size`` in
    ``request_size`` units; ``min_deadline`` may be earlier than the earliest still queued,
    never later, s on admission's clock)."""

    priority: int
    top: bool
    tenant: str
    waiters: deque[Waiter] = field(default_factory=deque)
    live: int = 0
    size: float = 0.0
    min_deadline: float = math.inf

    def __iter__(self) -> Iterator[Waiter]:
        return (w for w in self.waiters if not w.left)

    def head(self) -> Waiter | None:
        """The first request still queued (None: none)."""
        while self.waiters and self.waiters[0].left:
            self.waiters.popleft()
        return self.waiters[0] if self.waiters else None

    def add(self, waiter: Waiter) -> None:
        if self.waiters and self.waiters[-1].seq > waiter.seq:  # back from a hold: in order
            self.waiters = deque(sorted((*self.waiters, waiter), key=lambda w: w.seq))
        else:
            self.waiters.append(waiter)
        self.live += 1
        self.size += waiter.size
        self.min_deadline = min(self.min_deadline, waiter.deadline)

    def refresh_min_deadline(self, in_order: bool) -> None:
        """Make ``min_deadline`` the earliest deadline still queued (``in_order``: the
        deadlines follow arrival, :attr:`FairQueue.deadlines_in_order`)."""
        if in_order:
            head = self.head()
            self.min_deadline = head.deadline if head else math.inf
        else:
            self.min_deadline = min((w.deadline for w in self), default=math.inf)

    def drop(self, waiter: Waiter) -> None:
        self.live -= 1
        self.size -= waiter.size
        if len(self.waiters) > 2 * self.live + 16:  # many left from the middle: compact
            self.waiters = deque(self)


class FairQueue:
    """The queued requests of one variant: :class:`Group` s of those that may start once a
    slot is free, and the held ones (``Waiter.held``).

    ``deadlines_in_order``: no queued request's deadline is earlier than that of one that
    arrived before it (so while ``queue_timeout_s`` stays put and no hold ended; it holds
    again once the queue is empty)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, bool, str], Group] = {}
        self.held: list[Waiter] = []
        self.deadlines_in_order = True
        self._last_deadline = -math.inf

    def __len__(self) -> int:
        return sum(g.live for g in self._groups.values()) + len(self.held)

    @property
    def size(self) -> float:
        """The sizes of all queued requests, held ones included (``request_size`` units)."""
        return sum(g.size for g in self._groups.values()) + sum(w.size for w in self.held)

    @property
    def groups(self) -> list[Group]:
        """The groups with requests queued."""
        return list(self._groups.values())

    def tenants(self) -> set[str]:
        """Tenants with requests queued, held ones included."""
        return {g.tenant for g in self._groups.values()} | {w.tenant for w in self.held}

    def add(self, waiter: Waiter) -> None:
        if waiter.held:
            self.held.append(waiter)
            return
        if waiter.deadline < self._last_deadline:
            self.deadlines_in_order = False
        self._last_deadline = max(self._last_deadline, waiter.deadline)
        key = (waiter.priority, waiter.top, waiter.tenant)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = Group(waiter.priority, waiter.top, waiter.tenant)
        group.add(waiter)

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` is no longer queued (granted, refused, timed out, its client left);
        once only."""
        if waiter.left:
            return
        waiter.left = True
        if waiter.held:
            self.held.remove(waiter)
            return
        key = (waiter.priority, waiter.top, waiter.tenant)
        group = self._groups[key]
        group.drop(waiter)
        if not group.live:
            del self._groups[key]
            if not self._groups:
                self.deadlines_in_order, self._last_deadline = True, -math.inf

    def unhold(self) -> None:
        """The variant is warm: the held requests queue as the others do."""
        held, self.held = self.held, []
        if held and self._groups:  # they go before requests that arrived after them
            self.deadlines_in_order = False
        for w in held:
            w.held = False
            self.add(w)

