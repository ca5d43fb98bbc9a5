"""Admission control: bounded, priority-ordered queues in front of each variant.

Docs: docs/traffic-safety.md, "Overload". A vLLM engine runs ``max_num_seqs`` requests at
once. The router lets at most that many per running replica reach a variant (its *slots*)
and holds the rest in its own queue, ordered by tenant priority (vLLM's convention: lower
value first): Serve's handle queue is FIFO, so priority is decided here, before the request
is sent. Rules, per variant (``routes.<route>.admission`` in the router config):

- **Decide at arrival.** A request that can start now takes a slot. Otherwise it may wait
  if its estimated wait, ``(sizes of the requests ahead of it + its size) * service_s /
  slots`` (:mod:`serve_app.admission.service_time`; the slots the tenant may use), is within
  :data:`ADMIT_MARGIN` x ``queue_timeout_s``; else it is refused at once (``overloaded``)
  with a ``Retry-After``. ``max_queued_per_slot`` sets a fixed bound on the count instead.
- **A deadline.** A queued request not started after ``queue_timeout_s`` is refused
  (``queue_timeout``) before any byte; when service gets slower, queued requests that can
  no longer start in time are refused at once (``shed``: :mod:`serve_app.admission.shedding`).
- **Priority.** A better-priority request goes ahead of every worse one; the worse ones it
  pushes past their deadline are shed. ``reserved_slots`` are kept for the best priority.
- **Tenants' shares** (``fairness``, ``newcomer_slots``, ``anticipation_s``): token-fair
  order within a priority, slots kept for newcomers, a freed slot kept for its
  tenant a moment (:mod:`serve_app.admission.fair_share`).
- A variant with no running replica has no slots: ``unavailable`` (the router fails over).
- **A cold start holds what it can serve** (:meth:`VariantAdmission.expect_start`;
  :mod:`serve_app.variants.cold_start`): a request waiting for a start from zero is held if,
  once the first replica is warm, it would start within ``queue_timeout_s`` by the rule
  above (on its ``max_num_seqs`` less the slots kept back); the rest get 503 ``overloaded``
  at once. Once warm, a held request may wait ``queue_timeout_s`` or until its
  ``cold_start_timeout_s`` ends, whichever is later.

Admission holds per router replica. Refusals are 503 (the tenant's own limits, in
:mod:`serve_app.tenancy.limits`, cluster-wide, are 429). A decision costs about the number of
tenants queued, not of requests (:mod:`serve_app.admission.fair_queue`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable

from serve_app.admission import refusals
from serve_app.admission.fair_queue import FairQueue
from serve_app.admission.fair_share import FairShare, service_cost
from serve_app.admission.refusals import Rejected
from serve_app.admission.service_time import ServiceTime, request_size
from serve_app.admission.shedding import pushes_back, queued_ahead, shed_late, work_ahead
from serve_app.admission.slots import Ask, Counted, Slot, Waiter

#: Extra slots the best priority gets beyond the engines' capacity, as a share of it: those
#: requests wait inside vLLM, so the engine never idles between a request's end and the
#: router's next dispatch. The default of a route's ``admission.headroom``.
HEADROOM = 0.25
#: A request waits only if its estimated wait is within this share of ``queue_timeout_s``;
#: it is shed only past its deadline. The gap absorbs the estimate's noise, so a refusal
#: comes at arrival, when the client can still go elsewhere (docs/traffic-safety.md, "Overload").
ADMIT_MARGIN = 0.9
#: Slots assumed while a variant's capacity is not known.
UNKNOWN_CAPACITY = 1_000_000


class VariantAdmission:
    """The slots and queue of one variant.

    Args:
        variant: the variant application (for messages).
        queue_timeout_s: longest wait for a slot, s.
        reserved_slots: slots only the best priority may take.
        max_queued_per_slot: most requests waiting at once, per slot; None: what can start
            within ``queue_timeout_s`` (see :attr:`max_queued`).
        fairness, newcomer_slots, anticipation_s: the tenants' shares
            (:mod:`serve_app.admission.fair_share`).
        headroom: see :data:`HEADROOM`.
        clock: ``time.monotonic`` (tests pass a fake).
    """

    def __init__(self, variant: str, *, queue_timeout_s: float = 30.0, reserved_slots: int = 0,
                 max_queued_per_slot: float | None = None, fairness: str = "tokens",
                 newcomer_slots: int = 0, anticipation_s: float = 0.0,
                 headroom: float = HEADROOM, clock=time.monotonic) -> None:
        self.variant, self.headroom, self._clock = variant, headroom, clock
        self.service_time = ServiceTime()
        self.shares = FairShare(clock, self.service_time.tokens_per_s)
        self.capacity: int | None = None  # None: not known yet (treated as available)
        self.in_flight = 0
        self._queue = FairQueue()
        self._seq = itertools.count()
        self.starting_slots = 0  # slots of the replica a cold start brings (0: none under way)
        self.configure(queue_timeout_s=queue_timeout_s, reserved_slots=reserved_slots,
                       max_queued_per_slot=max_queued_per_slot, fairness=fairness,
                       newcomer_slots=newcomer_slots, anticipation_s=anticipation_s)

    # -- settings -----------------------------------------------------------------------------

    def configure(self, *, queue_timeout_s: float, reserved_slots: int,
                  max_queued_per_slot: float | None, fairness: str = "tokens",
                  newcomer_slots: int = 0, anticipation_s: float = 0.0,
                  headroom: float | None = None) -> None:
        self.shares.configure(fairness, newcomer_slots, anticipation_s)
        if headroom is not None:  # None: as it is (the constructor's)
            self.headroom = headroom
        self.queue_timeout_s = queue_timeout_s
        self.reserved_slots = reserved_slots
        self.max_queued_per_slot = max_queued_per_slot
        self._grant()

    @property
    def service(self) -> dict[str, float]:
        """Each tenant's service counted (its VTC counter, less what its running non-streams
        have been served so far: :meth:`FairShare.served_so_far`), tokens."""
        return self.shares.service

    def set_capacity(self, slots: int | None, full_batch_service_s: float = 0.0) -> None:
        """Slots of the variant now (``max_num_seqs`` x running replicas; None: unknown) and
        its replicas' start-up measure of a full batch (s; 0: none; ``service_s`` until the
        variant has been full). Slots after a cold start release the held requests."""
        self.capacity = slots
        self.service_time.start_up_measure(full_batch_service_s)
        if slots:
            self.starting_slots = 0
            deadline = self._clock() + self.queue_timeout_s
            for w in self._queue.held:  # see the module docstring: kept until its hold ends
                w.deadline = max(deadline, w.deadline)
            self._queue.unhold()
        self._grant()

    # -- cold starts ----------------------------------------------------------------------------

    def expect_start(self, slots: int) -> None:
        """A cold start is under way; its first replica will have ``slots`` (``max_num_seqs``).
        Until :meth:`set_capacity` gives slots, :meth:`enter` with ``hold_s`` may hold."""
        self.starting_slots = max(1, slots)

    def fail_start(self, rejected: Rejected) -> None:
        """The cold start failed: every held request gets ``rejected`` now."""
        self.starting_slots = 0
        for w in list(self._queue.held):
            w.future.set_exception(rejected)
            self._queue.leave(w)

    def _kept_back(self) -> int:
        """Engine slots a busy tenant of an ordinary priority may not take."""
        return max(self.reserved_slots, self.shares.newcomer_slots)

    def _held_slots(self) -> int:
        """Slots of a cold start's first replica that any held request may count on."""
        return max(1, self.starting_slots - self._kept_back())

    def held_limit(self, size: float = 1.0) -> int:
        """Requests of ``size`` a cold start holds (:meth:`expect_start`; 0 when none is under
        way): those its first replica can start within ``ADMIT_MARGIN x queue_timeout_s`` of
        being warm (the module docstring)."""
        if not self.starting_slots:
            return 0
        slots = self._held_slots()
        more = self.service_time.work_within(ADMIT_MARGIN * self.queue_timeout_s, slots)
        return int((slots + more) // max(1e-3, size))

    def slots_for(self, top: bool) -> int:
        """Slots a request may use. The best priority may use the engines' capacity plus
        :data:`HEADROOM` (so a finished request's engine slot is taken at once by one that
        already waits inside vLLM, in vLLM's priority order); the others leave
        ``reserved_slots`` of the capacity free (but get at least one)."""
        if self.capacity is None:  # not learned yet: Serve's own bounds apply
            return UNKNOWN_CAPACITY
        if top:
            return self.capacity + math.ceil(self.capacity * self.headroom)
        return max(1, self.capacity - self.reserved_slots)

    def tenant_slots(self, top: bool, tenant: str) -> int:
        """Slots a request of ``tenant`` may use: :meth:`slots_for`, less what
        :meth:`FairShare.tenant_slots` keeps from a tenant with requests in flight."""
        return self.shares.tenant_slots(self.slots_for(top), self.capacity, tenant)

    def _room(self, top: bool, tenant: str) -> int:
        """:meth:`tenant_slots` less the requests in flight counted against ``tenant``."""
        return self.tenant_slots(top, tenant) - self.shares.held_against(
            tenant, self.in_flight, self.capacity)

    def may_start(self, top: bool, tenant: str) -> bool:
        """Whether a request of ``tenant`` may take a slot now (:meth:`tenant_slots`; the
        slots kept for other tenants are taken)."""
        return self.shares.kept_for_others(tenant) < self._room(top, tenant)

    def _keep(self, slot: Slot) -> None:
        """Keep the slot ``slot`` freed for its tenant a moment (``anticipation_s``)."""
        waiting = [(g.tenant, g.priority) for g in self._queue.groups]
        self.shares.keep(slot.tenant, slot.priority, waiting,
                         self._room(slot.top, slot.tenant) > 0, self.capacity, then=self._grant)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def max_queued(self) -> int:
        """Most requests that may wait: ``max_queued_per_slot`` x slots when set, else what
        can start within ``queue_timeout_s`` at ``service_s`` (then the wait estimate is
        the bound: a better priority still goes ahead of a full queue)."""
        slots = self.slots_for(True)
        if self.max_queued_per_slot is not None:
            return math.ceil(self.max_queued_per_slot * slots)
        return max(1, math.ceil(self.service_time.work_within(self.queue_timeout_s, slots)))

    # -- requests -----------------------------------------------------------------------------

    async def take(self, ask: Ask, *, hold_s: float | None = None,
                   wake: Callable[[], None] | None = None) -> Slot:
        """The slot ``ask``'s request runs in, whether the variant runs or sleeps.

        Its size and how its service counts come from its reservation (:func:`request_size`
        of its completion bound; :func:`service_cost` of its prompt, and of a non-stream's
        completion by the time it runs). ``wake``: for a variant that may be asleep, called
        first when it has no slot (no running replica): it starts the cold start (and may
        refuse, raising); the request is then held up to ``hold_s`` s for the first replica
        (:meth:`enter`).

        Raises:
            Rejected: ``unavailable`` (no running replica and nothing to wait for), or it
                cannot start in time (``overloaded``, ``queue_timeout``, ``shed``,
                ``cold_start_timeout``, what :meth:`fail_start` was given).
        """
        if wake is not None and self.capacity == 0:
            wake()
        counts = Counted(service_cost(ask.prompt_tokens, 0),
                         0.0 if ask.stream else service_cost(0, ask.completion_tokens))
        ticket = self.enter(ask.priority, ask.top, ask.tenant,
                            request_size(ask.completion_tokens),
                            hold_s=hold_s if wake is not None else None, counts=counts)
        return ticket if isinstance(ticket, Slot) else await self.wait(ticket)

    def settle(self, slot: Slot, used: tuple[int, int] | None) -> None:
        """Give back the slot of a request that ended (once): ``used`` its (prompt,
        completion) tokens, which replace the service counted while it ran and teach the
        service time what it generated; None when what it used is not known (a non-stream
        its client abandoned while it ran: its counted service stays)."""
        if used is None:
            self.release(slot)
        else:
            self.release(slot, cost=service_cost(*used),
                         size=request_size(used[1]) if used[1] else None)

    def give_back(self, slot: Slot) -> None:
        """Give back the slot of a request that did not run here (it failed over, or was
        refused before the call): nothing counted, nothing learnt."""
        self.release(slot, cost=0.0)

    def served_tokens(self, slot: Slot, completion_tokens: int) -> None:
        """``slot``'s stream was relayed ``completion_tokens`` more (its tenant's service)."""
        if completion_tokens > 0:
            self.served(slot, service_cost(0, completion_tokens))

    async def acquire(self, priority: int, top: bool, tenant: str = "",
                      size: float = 1.0, counts: Counted = Counted()) -> Slot:
        """Wait for a slot: :meth:`enter`, then :meth:`wait` (raises Rejected: it cannot
        start in time)."""
        ticket = self.enter(priority, top, tenant, size, counts=counts)
        return ticket if isinstance(ticket, Slot) else await self.wait(ticket)

    def enter(self, priority: int, top: bool, tenant: str = "", size: float = 1.0,
              hold_s: float | None = None, counts: Counted = Counted()) -> Slot | Waiter:
        """Decide at arrival, without waiting: a slot now, or a place in the queue to
        :meth:`wait` on.

        Args:
            priority: the request's priority (lower is served first).
            top: the request has the best priority configured (may use reserved slots).
            tenant: the tenant id ("" in open mode).
            size: ``request_size`` of its reservation (:mod:`~serve_app.admission.service_time`;
                1.0: a short request).
            hold_s: the request may be held for a cold start under way
                (:meth:`expect_start`) this long, s (the route's ``cold_start_timeout_s``).
            counts: how its service counts while it runs (:class:`Counted`).

        Raises:
            Rejected: ``unavailable`` (no running replica, no cold start to wait for) or
                ``overloaded`` (it could not start in time).
        """
        now = self._clock()
        held = self.capacity == 0 and hold_s is not None and self.starting_slots > 0
        if self.capacity == 0 and not held:
            raise refusals.unavailable(self.variant)
        self.shares.lift(tenant, self._queue.tenants())
        if held:
            # held work (first-come) starts on the first replica: _held_slots at once, the rest
            # at service_s each
            work, slots = self._queue.size + size, self._held_slots()
            wait_s = self.service_time.wait_s(max(0.0, work - slots), slots)
            if wait_s > ADMIT_MARGIN * self.queue_timeout_s:
                raise refusals.holds_all_it_can(self.variant, self.queue_timeout_s,
                                                self.held_limit(size), wait_s)
            deadline = now + hold_s
        else:
            ahead, held_ahead = queued_ahead(self._queue, priority, tenant, self._counters())
            if not ahead and not held_ahead and self.may_start(top, tenant):
                return self._start(tenant, now, size, priority, top, counts)
            work = work_ahead(ahead, held_ahead, self.shares.free_newcomer_slots, self._fits)
            wait_s = self.service_time.wait_s(work + size, self.tenant_slots(top, tenant))
            fixed_bound = self.max_queued_per_slot is not None  # else the estimate bounds it
            if wait_s > ADMIT_MARGIN * self.queue_timeout_s or (
                    fixed_bound and self.queued >= self.max_queued):
                raise refusals.overloaded(self.variant, self.queue_timeout_s, self.in_flight,
                                          self.queued, wait_s)
            deadline = now + self.queue_timeout_s
        waiter = Waiter(priority, next(self._seq), deadline, top,
                         asyncio.get_running_loop().create_future(), tenant, size, counts,
                         held=held, hold_s=hold_s or 0.0)
        self._queue.add(waiter)
        if not held:
            self._shed_behind(waiter, now)
            self._grant()  # those ahead may be held back by newcomer_slots: this one may not
        return waiter

    async def wait(self, waiter: Waiter) -> Slot:
        """Wait for the slot of a request :meth:`enter` queued, until its deadline (a held
        request's moves to ``queue_timeout_s`` after the variant is warm).

        Raises:
            Rejected: ``queue_timeout``, ``shed``, ``cold_start_timeout``, or what
                :meth:`fail_start` was given.
        """
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter.future),
                                                  max(0.0, waiter.deadline - self._clock()))
                except asyncio.TimeoutError:
                    if waiter.future.done():  # granted, or rejected, as the timer fired
                        return waiter.future.result()
                    if self._clock() < waiter.deadline:
                        continue  # the variant became warm: a new deadline
                    waiter.future.cancel()
                    if waiter.held:
                        raise refusals.cold_start_timeout(self.variant, waiter.hold_s) from None
                    raise refusals.queue_timeout(self.variant, self.queue_timeout_s,
                                                 self.service_time.s) from None
        except asyncio.CancelledError:  # the client left while queued
            if _granted(waiter.future):
                self.release(waiter.future.result(), cost=0.0)  # it never ran
            waiter.future.cancel()
            raise
        finally:
            if waiter.future.done():
                self._queue.leave(waiter)

    def release(self, slot: Slot, cost: float | None = None, size: float | None = None
                ) -> None:
        """Give a slot back (once) and learn its service time. ``cost``: the request's real
        service (``service_cost`` of its usage), which replaces what was counted while it
        ran (None keeps that). ``size``: the ``request_size`` of what it generated; None when
        it generated nothing (it failed over, was refused, its client left)."""
        if slot.released:
            return
        slot.released = True
        # Full: as busy as admission lets a busy tenant of an ordinary priority make it (the
        # engines' slots but the reserved and the newcomer ones).
        full = self.capacity is not None and self.in_flight >= max(
            1, self.capacity - self._kept_back())
        self.in_flight -= 1
        self.shares.end(slot, cost)
        if full and size is not None:  # held while full, by a request that generated tokens
            self.service_time.learn(self._clock() - slot.granted_at, size)
        if size is not None:  # it ended as requests do: its client may send the next one
            self._keep(slot)
        self._grant()
        self._shed_late()

    def served(self, slot: Slot, cost: float) -> None:
        """``slot``'s stream was served ``cost`` more (weighted tokens, as relayed)."""
        if not slot.released:
            self.shares.served(slot, cost)

    # -- internals ----------------------------------------------------------------------------

    def _counters(self) -> Callable[[str], float]:
        """Each tenant's place in the order within a priority (its service with ``fairness:
        tokens``, :meth:`FairShare.counter`), read once a tenant: it moves with time, and a
        decision sees one order."""
        counters: dict[str, float] = {}

        def counter(tenant: str) -> float:
            if tenant not in counters:
                counters[tenant] = self.shares.counter(tenant)
            return counters[tenant]
        return counter

    def _fits(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` may start in a free newcomer slot
        (:meth:`FairShare.fits_newcomer_slot`)."""
        return self.shares.fits_newcomer_slot(tenant, self.capacity)

    def _start(self, tenant: str, now: float, size: float = 1.0, priority: int = 0,
               top: bool = True, counts: Counted = Counted()) -> Slot:
        newcomer = self.shares.takes_newcomer_slot(tenant, self.in_flight, self.capacity)
        slot = Slot(now, tenant, size=size, priority=priority, top=top, newcomer=newcomer,
                    counts=counts)
        self.shares.start(slot)
        self.in_flight += 1
        return slot

    def _grant(self) -> None:
        """Hand free slots to the best waiters that may use them. The queue's order is
        priority, then the tenant's counter (:meth:`_counters`), then arrival; each
        :class:`~serve_app.admission.fair_queue.Group` is one tenant's requests of one priority,
        first-come, so the candidates are the groups' heads."""
        while True:
            counter = self._counters()  # read again: a start moves its tenant's counter
            heads = [((g.priority, counter(g.tenant), g.head().seq), g)
                     for g in self._queue.groups]
            if not heads:
                return
            (best_priority, _, _), best = min(heads, key=lambda h: h[0])
            if self.in_flight >= self.slots_for(best.top):
                return
            # The best waiter, else (newcomer_slots held it back) the next of its priority
            # whose tenant is a newcomer.
            chosen = min((h for h in heads if h[1].priority == best_priority
                          and self.may_start(h[1].top, h[1].tenant)),
                         key=lambda h: h[0], default=None)
            if chosen is None:
                return
            waiter = chosen[1].head()
            self._queue.leave(waiter)
            waiter.future.set_result(self._start(
                waiter.tenant, self._clock(), waiter.size, waiter.priority, waiter.top,
                waiter.counts))

    def _shed_behind(self, newcomer: Waiter, now: float) -> None:
        """Reject queued requests of worse priority that ``newcomer`` pushes past their
        deadline (:func:`~serve_app.admission.shedding.pushes_back`)."""
        if pushes_back(self._queue, newcomer, self._counters()):
            self._shed_late(now)

    def _shed_late(self, now: float | None = None) -> None:
        """Reject (``shed``) the queued requests whose estimated start is past their
        deadline, worst priority first to go (:func:`~serve_app.admission.shedding.shed_late`)."""
        now = self._clock() if now is None else now
        late = shed_late(self._queue, now, self._counters(), self.service_time,
                         self.tenant_slots, self._fits, self.shares.free_newcomer_slots)
        for w in late:
            w.future.set_exception(refusals.shed(self.variant, self.queue_timeout_s,
                                                 self.service_time.s))


def _granted(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
