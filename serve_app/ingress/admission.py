"""Admission control: bounded, priority-ordered queues in front of each variant.

A vLLM engine runs ``max_num_seqs`` requests at once. The router lets at most that many per
running replica reach a variant (its *slots*) and holds the rest in its own queue, ordered
by tenant priority (vLLM's convention: lower value first; FIFO within a priority). Ray
Serve's handle queue is FIFO, so priority has to be decided here, before the request is
sent; the engine's own priority scheduling (``scheduling_policy: priority``) then orders
whatever reaches it.

Rules, per variant (``routes.<route>.admission`` in the router config):

- **Decide at arrival.** A request that can start now takes a slot. Otherwise it may wait
  if its estimated wait, ``(sizes of the requests ahead of it + its size) * service_s /
  slots``, is within :data:`ADMIT_MARGIN` x ``queue_timeout_s``; else it is rejected at once (``overloaded``) with
  a ``Retry-After``: no client is left hanging on a queue that cannot serve it in time. A
  request's *size* (:func:`request_size`) is its ``max_tokens`` (its token reservation) plus
  :data:`PREFILL_TOKENS`, relative to a request of
  :data:`~serve_app.common.wire.CALIBRATION_TOKENS` tokens: a 64-token stream holds its
  slot about three times as long as a 16-token one. ``service_s`` is how long a request of
  size 1 holds a slot *while the variant is full*, s: a moving average over the requests
  released while every slot was taken, per unit of the size they generated (an idle
  variant's requests finish several times faster than a full one's, so those would make the
  queue admit far more than can start in time). Until the variant has been full,
  ``service_s`` is what its replicas measured at start-up for a full batch of such requests
  (``ReplicaInfo.full_batch_service_s``), so the queue holds about what can start within
  ``queue_timeout_s`` from the first burst on. That measure runs inside the engine, with no
  HTTP path and no client on the host: on a 2-core host the real figure under load is about
  twice it, and the first burst is over-admitted until its first requests finish (then the
  excess is shed). The slots in the estimate are those the tenant may use
  (:meth:`VariantAdmission.tenant_slots`). ``max_queued_per_slot`` sets a fixed bound
  on the count instead (x slots).
- **A deadline.** A queued request that has not started after ``queue_timeout_s`` is
  rejected (``queue_timeout``), before any byte is sent; when a finished request shows that
  service got slower, queued requests that can no longer start in time are rejected at
  once (``shed``) rather than at their deadline.
- **Priority.** A better-priority request goes ahead of every worse one in the queue; the
  worse ones it pushes past their deadline are rejected at once (``shed``): low-priority
  work is shed first. ``reserved_slots`` slots are kept for the best priority configured,
  so its requests start at once even while worse ones fill the variant.
- **Token-fair within a priority** (``fairness: tokens``, the default). Among queued
  requests of one priority, the tenant with the least service so far goes first (FIFO
  within a tenant). A tenant's service is its virtual token counter, as in the VTC
  scheduler (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
  ``PROMPT_WEIGHT x prompt + COMPLETION_WEIGHT x completion`` tokens. A request is charged
  its reservation when it starts (so a tenant's long streams count while they run) and
  corrected to its real usage when it ends. A tenant that arrives with nothing queued or
  running has its counter lifted to the least counter among the tenants that have
  requests queued or running, so time spent idle earns no burst of credit; on an idle
  variant, to the greatest counter, so the contention of an hour ago (a tenant that was
  served a lot then, one that was away) does not decide the next one. ``fairness: fifo`` keeps arrival
  order (the baseline the fair order is measured against).
- **A slot for a tenant that has none** (``newcomer_slots``, default 1, with ``fairness:
  tokens`` and tenants configured). A tenant that already has requests in flight on the
  variant may hold at most ``capacity - newcomer_slots`` of its engine slots (and none of
  the best priority's headroom), so another tenant's request finds an engine slot free and
  starts at once. A request running in that slot does not count against the busy tenants'
  share (counted, it left one more engine slot idle while it ran: the burst of 400 on the
  virtual clock ran 6 + 1 requests on 8 slots). The fair order alone cannot do that: it
  decides which queued request goes next, but each waits for a running one to end (a long
  stream: many seconds), and vLLM does not preempt a running request to make room. The cost is one engine slot of
  ``max_num_seqs`` while only one tenant is busy.
- **A freed slot is kept for its tenant a moment** (``anticipation_s``, default 0.05 s,
  with ``fairness: tokens`` and tenants configured): when a request ends and its tenant
  would be served next (less service than every tenant waiting at the best priority
  waiting, none better than its own), its slot stays that tenant's for
  ``anticipation_s``. A client that sends its next request when the last one ends (most
  do) would otherwise lose the slot to the queue in the moment between the two and wait
  for another request to end: measured on the simulated engine, a light tenant keeping 4
  requests going waited 0.4-1.7 s per request in the router and got 28-32 % of the service
  against a heavy tenant's 16 (43-46 % with this rule). Anticipatory scheduling, as disks
  do it (Iyer and Druschel, "Anticipatory scheduling", SOSP 2001): a slot idles at most
  ``anticipation_s``.
- A variant with no running replica has no slots: ``unavailable`` (the router fails over).
- **A cold start holds what it can serve** (:meth:`VariantAdmission.expect_start`). While a
  variant starts from zero, requests that wait for it queue here with the slots its first
  replica will have: a request is held if, once that replica is warm, it would start within
  ``queue_timeout_s`` by the rule above (its ``max_num_seqs`` less the ``reserved_slots`` or
  ``newcomer_slots`` kept back at once, the rest at ``service_s`` per size on those); the
  rest get 503 ``overloaded`` at once, before any byte. A held
  request waits at most ``cold_start_timeout_s`` for the replica (``cold_start_timeout``);
  once it is warm, held requests get its slots in the queue's order (priority, then
  token-fair), no more at a time than it takes, and each may wait ``queue_timeout_s`` from
  then or until its ``cold_start_timeout_s`` ends, whichever is later: what was held was
  counted on the start-up measure, and an engine slower than measured (a 2-core host
  under a second herd) must not shed held streams, whose 200 went out, in-band.
  A start that fails ends every held request (``cold_start_failed``, with the reason).

Admission holds per router replica. Rejections are 503 (the tenant's own limits, in
:mod:`serve_app.tenancy.limits`, cluster-wide, are 429).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass

from serve_app.common.wire import CALIBRATION_TOKENS

#: Slot-holding time assumed while a variant has not been full and its replicas measured
#: nothing at start-up, s.
PRIOR_SERVICE_S = 2.0
#: Weight of each new sample in the moving average of service time (the n-th of the first
#: samples weighs 1/n: a running mean, so a variant's first burst soon replaces the start-up
#: measure).
EWMA_ALPHA = 0.2
#: Extra slots the best priority gets beyond the engines' capacity, as a share of it: those
#: requests wait inside vLLM, so the engine never idles between a request's end and the
#: router's next dispatch.
HEADROOM = 0.25
#: A request waits only if its estimated wait is within this share of ``queue_timeout_s``;
#: it is shed only past its deadline. The gap absorbs the estimate's noise (one slow
#: request moves ``service_s``), so an admitted request is seldom shed later: a refusal
#: comes at arrival, when the client can still go elsewhere. 0.8 answered 0.76-0.79 of
#: what the engines could finish in a 400-burst on the simulated engine, where the estimate
#: is exact, against the goal of 0.8: the margin was the limit, not the estimate.
ADMIT_MARGIN = 0.9
#: Slots assumed while a variant's capacity is not known.
UNKNOWN_CAPACITY = 1_000_000
#: Bounds of the Retry-After a rejection suggests, s.
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 10
#: Weights of prompt and completion tokens in a tenant's service (VTC's, OSDI 2024 §4:
#: a generated token costs the engine about twice a prompt token).
PROMPT_WEIGHT, COMPLETION_WEIGHT = 1.0, 2.0


#: A request's fixed cost (its prefill, its scheduling) in generated-token equivalents, for
#: :func:`request_size`: a rough figure for short prompts on this CPU host.
PREFILL_TOKENS = 8


def request_size(completion_tokens: int) -> float:
    """How long a request holds a slot, relative to one of ``CALIBRATION_TOKENS`` generated
    tokens: ``(completion_tokens + PREFILL_TOKENS) / (CALIBRATION_TOKENS + PREFILL_TOKENS)``.
    Decode dominates a request's time in a full batch, so size follows its tokens."""
    return (max(0, completion_tokens) + PREFILL_TOKENS) / (CALIBRATION_TOKENS + PREFILL_TOKENS)


def service_cost(prompt_tokens: int, completion_tokens: int) -> float:
    """A request's weighted service, tokens."""
    return PROMPT_WEIGHT * prompt_tokens + COMPLETION_WEIGHT * completion_tokens


class Rejected(Exception):
    """A request the variant cannot start in time.

    Attributes:
        reason: ``overloaded`` (at arrival), ``queue_timeout`` (deadline passed while
            queued), ``shed`` (pushed past its deadline by better-priority requests) or
            ``unavailable`` (no running replica).
        retry_after_s: when a retry may succeed, s (whole seconds).
    """

    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class _Waiter:
    priority: int
    seq: int
    deadline: float
    top: bool
    future: asyncio.Future
    tenant: str = ""
    cost: float = 0.0  # service charged when it starts
    size: float = 1.0  # request_size of its reservation
    held: bool = False  # waits for a cold start (no slot may be granted before it is warm)
    hold_s: float = 0.0  # the longest it may wait for that, s


@dataclass
class Slot:
    """A granted slot; give it back with :meth:`VariantAdmission.release`."""

    granted_at: float
    tenant: str = ""
    charged: float = 0.0  # service charged at the start (its reservation)
    size: float = 1.0  # request_size of its reservation
    released: bool = False
    priority: int = 0
    top: bool = True
    newcomer: bool = False  # in a newcomer slot: its tenant had nothing in flight


class VariantAdmission:
    """The slots and queue of one variant.

    Args:
        variant: the variant application (for messages).
        queue_timeout_s: longest wait for a slot, s.
        reserved_slots: slots only the best priority may take.
        max_queued_per_slot: most requests waiting at once, per slot; None: what can start
            within ``queue_timeout_s`` (see :attr:`max_queued`).
        newcomer_slots: engine slots a tenant with requests in flight may not take (see the
            module docstring); applies with ``fairness: tokens`` to named tenants.
        anticipation_s: how long a freed slot stays its tenant's, s (see the module
            docstring); with ``fairness: tokens``, named tenants.
        headroom: see :data:`HEADROOM`.
        clock: ``time.monotonic`` (tests pass a fake).
    """

    def __init__(self, variant: str, *, queue_timeout_s: float = 30.0, reserved_slots: int = 0,
                 max_queued_per_slot: float | None = None, fairness: str = "tokens",
                 newcomer_slots: int = 0, anticipation_s: float = 0.0,
                 headroom: float = HEADROOM, clock=time.monotonic) -> None:
        self.newcomer_slots = newcomer_slots
        self.anticipation_s = anticipation_s
        self._kept: list[tuple[str, float]] = []  # (tenant, until): slots kept for it
        self.variant = variant
        self.headroom = headroom
        self.queue_timeout_s = queue_timeout_s
        self.reserved_slots = reserved_slots
        self.max_queued_per_slot = max_queued_per_slot
        self.fairness = fairness
        self.capacity: int | None = None  # None: not known yet (treated as available)
        self.in_flight = 0
        self.service_s = PRIOR_SERVICE_S
        self._full_samples = 0  # releases service_s was learned from (the variant full)
        self.service: dict[str, float] = {}  # tenant -> virtual token counter (VTC)
        self._running: dict[str, int] = {}  # tenant -> slots held
        self._newcomers = 0  # slots held in newcomer slots (at most newcomer_slots)
        self._clock = clock
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self.starting_slots = 0  # slots of the replica a cold start brings (0: none under way)

    # -- settings -----------------------------------------------------------------------------

    def configure(self, *, queue_timeout_s: float, reserved_slots: int,
                  max_queued_per_slot: float | None, fairness: str = "tokens",
                  newcomer_slots: int = 0, anticipation_s: float = 0.0) -> None:
        self.newcomer_slots = newcomer_slots
        self.anticipation_s = anticipation_s
        self.queue_timeout_s = queue_timeout_s
        self.reserved_slots = reserved_slots
        self.max_queued_per_slot = max_queued_per_slot
        self.fairness = fairness
        self._grant()

    def set_capacity(self, slots: int | None, full_batch_service_s: float = 0.0) -> None:
        """Slots of the variant now (``max_num_seqs`` x running replicas; None: unknown) and
        its replicas' start-up measure of a full batch (s; 0: none), which ``service_s``
        is until the variant has been full. Slots after a cold start release the held
        requests (each waits ``queue_timeout_s`` from now, or to the end of its hold if
        later)."""
        self.capacity = slots
        if not self._full_samples:
            self.service_s = full_batch_service_s or PRIOR_SERVICE_S
        if slots:
            self.starting_slots = 0
            deadline = self._clock() + self.queue_timeout_s
            for w in self._waiting():
                if w.held:  # see the module docstring: kept until its hold would have ended
                    w.held, w.deadline = False, max(deadline, w.deadline)
        self._grant()

    # -- cold starts ----------------------------------------------------------------------------

    def expect_start(self, slots: int) -> None:
        """A cold start of the variant is under way; its first replica will have ``slots``
        (its ``max_num_seqs``). Until :meth:`set_capacity` gives slots, requests may be held
        (:meth:`enter` with ``hold_s``)."""
        self.starting_slots = max(1, slots)

    def fail_start(self, rejected: Rejected) -> None:
        """The cold start failed: every held request gets ``rejected`` now."""
        self.starting_slots = 0
        for w in self._waiting():
            if w.held:
                w.future.set_exception(rejected)
        self._prune()

    def _held_slots(self) -> int:
        """Slots of the first replica a held request may count on: its ``max_num_seqs`` less
        those kept back (``reserved_slots`` for the best priority, ``newcomer_slots`` for a
        tenant with nothing in flight), whoever the held requests are; so every request held
        starts within ``queue_timeout_s`` by the rules that release it (no held request is
        shed)."""
        return max(1, self.starting_slots - max(self.reserved_slots, self.newcomer_slots))

    def _held_wait_s(self, work: float) -> float:
        """Seconds after the replica is warm until held ``work`` (sizes, own included) has
        started: the first :meth:`_held_slots` at once, the rest at ``service_s`` each."""
        slots = self._held_slots()
        return self._estimate(max(0.0, work - slots), slots)

    def held_limit(self, size: float = 1.0) -> int:
        """Requests of ``size`` a cold start holds (:meth:`expect_start`; 0 when none is under
        way): those its first replica can start within ``ADMIT_MARGIN x queue_timeout_s`` of
        being warm (:meth:`_held_wait_s`; the module docstring)."""
        if not self.starting_slots:
            return 0
        slots = self._held_slots()
        more = ADMIT_MARGIN * self.queue_timeout_s * slots / max(1e-3, self.service_s)
        return int((slots + more) // max(1e-3, size))

    def slots_for(self, top: bool) -> int:
        """Slots a request may use. The best priority may use the engines' capacity plus
        :data:`HEADROOM` (so a finished request's engine slot is taken at once by one that
        already waits inside vLLM, in vLLM's priority order); the others leave
        ``reserved_slots`` of the capacity free (but get at least one)."""
        if self.capacity is None:  # not learned yet: Serve's own bounds apply
            return UNKNOWN_CAPACITY
        return self._slots_of(self.capacity, top)

    def _slots_of(self, capacity: int, top: bool) -> int:
        if top:
            return capacity + math.ceil(capacity * self.headroom)
        return max(1, capacity - self.reserved_slots)

    def _newcomer_rule(self, tenant: str) -> bool:
        return bool(self.newcomer_slots and tenant and self.fairness == "tokens"
                    and self.capacity is not None)

    def tenant_slots(self, top: bool, tenant: str) -> int:
        """Slots a request of ``tenant`` may use: :meth:`slots_for`, and, for a tenant with
        requests in flight, none of the ``newcomer_slots`` engine slots."""
        slots = self.slots_for(top)
        if self._newcomer_rule(tenant) and self._running.get(tenant):
            return min(slots, max(1, self.capacity - self.newcomer_slots))
        return slots

    def _held_against(self, tenant: str) -> int:
        """Slots in flight that count against ``tenant``'s :meth:`tenant_slots`: all, but
        for a tenant with requests in flight not those in newcomer slots, which it may not
        use (else a newcomer running would leave one engine slot idle)."""
        if self._newcomer_rule(tenant) and self._running.get(tenant):
            return self.in_flight - self._newcomers
        return self.in_flight

    def _work(self, w: _Waiter) -> float:
        """What a queued request adds to the wait of those behind it: its size, or nothing
        when it will start in a newcomer slot (its tenant has nothing in flight), which
        the requests of busy tenants may not use anyway."""
        return 0.0 if self._newcomer_rule(w.tenant) and not self._running.get(w.tenant) \
            else w.size

    def may_start(self, top: bool, tenant: str) -> bool:
        """Whether a request of ``tenant`` may take a slot now (:meth:`tenant_slots`; the
        slots kept for other tenants are taken)."""
        return (self._held_against(tenant) + self._kept_for_others(tenant)
                < self.tenant_slots(top, tenant))

    def _kept_for_others(self, tenant: str) -> int:
        if not self._kept:
            return 0
        now = self._clock()
        self._kept = [k for k in self._kept if k[1] > now]
        return sum(1 for t, _ in self._kept if t != tenant)

    def _keep(self, slot: Slot) -> None:
        """Keep the slot ``slot``'s request just freed for its tenant's next request
        (``anticipation_s``) when that tenant would be served next: it has had less service
        than every tenant waiting at the best priority waiting, none waiting has a better
        priority than it, none of its own requests waits (that one takes the slot at once),
        and it may use the slot."""
        tenant = slot.tenant
        if not (self.anticipation_s > 0 and tenant and self.fairness == "tokens"
                and self.capacity is not None):
            return
        waiting = [w for w in self._waiting() if not w.held]
        if not waiting or any(w.tenant == tenant for w in waiting) \
                or self._held_against(tenant) >= self.tenant_slots(slot.top, tenant):
            return
        best = min(w.priority for w in waiting)
        mine = self.service.get(tenant, 0.0)
        if best < slot.priority or any(self.service.get(w.tenant, 0.0) <= mine
                                       for w in waiting if w.priority == best):
            return
        kept = (tenant, self._clock() + self.anticipation_s)
        self._kept.append(kept)
        try:  # then the slot goes to the queue, whatever the clocks' rounding
            asyncio.get_running_loop().call_later(self.anticipation_s, self._expire, kept)
        except RuntimeError:  # no loop (a unit test's direct call): the next decision sees it
            pass

    def _expire(self, kept: tuple[str, float]) -> None:
        if kept in self._kept:
            self._kept.remove(kept)
        self._grant()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._queue if not w.future.done())

    @property
    def max_queued(self) -> int:
        """Most requests that may wait: ``max_queued_per_slot`` x slots when set, else what
        can start within ``queue_timeout_s`` at ``service_s`` (then the wait estimate is
        the bound: a better priority still goes ahead of a full queue)."""
        slots = self.slots_for(True)
        if self.max_queued_per_slot is not None:
            return math.ceil(self.max_queued_per_slot * slots)
        return max(1, math.ceil(self.queue_timeout_s * slots / max(1e-3, self.service_s)))

    # -- requests -----------------------------------------------------------------------------

    async def acquire(self, priority: int, top: bool, tenant: str = "",
                      cost: float = 0.0, size: float = 1.0) -> Slot:
        """Wait for a slot, in priority order, token-fair among ``tenant``s of one priority
        (:meth:`enter`, then :meth:`wait`).

        Raises:
            Rejected: it cannot start in time (see the module docstring).
        """
        ticket = self.enter(priority, top, tenant, cost, size)
        return ticket if isinstance(ticket, Slot) else await self.wait(ticket)

    def enter(self, priority: int, top: bool, tenant: str = "", cost: float = 0.0,
              size: float = 1.0, hold_s: float | None = None) -> Slot | _Waiter:
        """Decide at arrival, without waiting: a slot now, or a place in the queue to
        :meth:`wait` on.

        Args:
            priority: the request's priority (lower is served first).
            top: the request has the best priority configured (may use reserved slots).
            tenant: the tenant id ("" in open mode).
            cost: the service charged to ``tenant`` when it starts (:func:`service_cost` of
                its reservation, tokens); :meth:`release` corrects it.
            size: :func:`request_size` of its reservation (1.0: a short request).
            hold_s: the request may be held for a cold start under way
                (:meth:`expect_start`) this long, s (the route's ``cold_start_timeout_s``).

        Raises:
            Rejected: ``unavailable`` (no running replica, no cold start to wait for) or
                ``overloaded`` (it could not start in time).
        """
        now = self._clock()
        held = self.capacity == 0 and hold_s is not None and self.starting_slots > 0
        if self.capacity == 0 and not held:
            raise Rejected("unavailable", f"variant {self.variant} has no running replica",
                           MIN_RETRY_AFTER_S)
        self._lift(tenant)
        key = self._key(priority, tenant, math.inf)
        ahead = [w for w in self._waiting() if self._order(w) <= key]
        if held:
            work = sum(w.size for w in self._waiting()) + size  # all of them go first-come
            wait_s = self._held_wait_s(work)
            if wait_s > ADMIT_MARGIN * self.queue_timeout_s:
                raise Rejected("overloaded", f"variant {self.variant} is starting from zero "
                               f"replicas and holds what its first replica can start within "
                               f"queue_timeout_s {self.queue_timeout_s:g} once warm (about "
                               f"{self.held_limit(size)} requests this size), and that many "
                               "wait already; retry once it has started",
                               self._retry_after(wait_s))
            deadline = now + hold_s
        else:
            if not ahead and self.may_start(top, tenant):
                return self._start(tenant, cost, now, size, priority, top)
            wait_s = self._estimate(sum(self._work(w) for w in ahead) + size,
                                    self.tenant_slots(top, tenant))
            fixed_bound = self.max_queued_per_slot is not None  # else the estimate bounds it
            if wait_s > ADMIT_MARGIN * self.queue_timeout_s or (
                    fixed_bound and self.queued >= self.max_queued):
                raise Rejected("overloaded", f"variant {self.variant} is at capacity: "
                               f"{self.in_flight} requests running, {self.queued} queued; this "
                               f"one would wait about {wait_s:.0f} s (queue_timeout_s "
                               f"{self.queue_timeout_s:g}); retry later",
                               self._retry_after(wait_s - self.queue_timeout_s))
            deadline = now + self.queue_timeout_s
        waiter = _Waiter(priority, next(self._seq), deadline, top,
                         asyncio.get_running_loop().create_future(), tenant, cost, size,
                         held=held, hold_s=hold_s or 0.0)
        self._queue.append(waiter)
        if not held:
            self._shed_behind(waiter, now)
            self._grant()  # those ahead may be held back by newcomer_slots: this one may not
        return waiter

    async def wait(self, waiter: _Waiter) -> Slot:
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
                        raise Rejected("cold_start_timeout", f"variant {self.variant} is "
                                       "starting from zero replicas and did not start within "
                                       f"cold_start_timeout_s {waiter.hold_s:g}; retry later",
                                       MAX_RETRY_AFTER_S) from None
                    raise Rejected("queue_timeout", f"variant {self.variant} could not start "
                                   f"the request within queue_timeout_s "
                                   f"{self.queue_timeout_s:g}; retry later",
                                   self._retry_after(self.service_s)) from None
        except asyncio.CancelledError:  # the client left while queued
            if _granted(waiter.future):
                self.release(waiter.future.result(), cost=0.0)  # it never ran
            waiter.future.cancel()
            raise
        finally:
            self._prune()

    def release(self, slot: Slot, cost: float | None = None, size: float | None = None
                ) -> None:
        """Give a slot back (once; later calls do nothing) and learn its service time.
        ``cost``: the request's real service (:func:`service_cost` of its usage), which
        replaces what it was charged at the start; None keeps that. ``size``: the
        :func:`request_size` of what it generated; None when it generated nothing (it
        failed over, was refused, its client left): then it teaches ``service_s`` nothing."""
        if slot.released:
            return
        slot.released = True
        # Full: as busy as admission lets a busy tenant of an ordinary priority make it (the
        # engines' slots but the reserved and the newcomer ones).
        full = self.capacity is not None and self.in_flight >= max(
            1, self.capacity - max(self.reserved_slots, self.newcomer_slots))
        self.in_flight -= 1
        self._newcomers -= slot.newcomer
        self._running[slot.tenant] = max(0, self._running.get(slot.tenant, 0) - 1)
        if cost is not None:
            self.service[slot.tenant] = self.service.get(slot.tenant, 0.0) + cost - slot.charged
        if full and size is not None:  # held while full, by a request that generated tokens
            held = (self._clock() - slot.granted_at) / max(1e-3, size)
            self._full_samples += 1  # the first ones replace the start-up measure quickly
            self.service_s += max(EWMA_ALPHA, 1 / self._full_samples) * (held - self.service_s)
        if size is not None:  # it ended as requests do: its client may send the next one
            self._keep(slot)
        self._grant()
        self._shed_late()

    # -- internals ----------------------------------------------------------------------------

    def _estimate(self, work: float, slots: int) -> float:
        """Seconds until a queued request starts when ``work`` (the sizes of the requests
        ahead of it and its own) must be served first."""
        return work * self.service_s / max(1, slots)

    @staticmethod
    def _retry_after(seconds: float) -> int:
        return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(seconds))))

    def _key(self, priority: int, tenant: str, seq: float) -> tuple:
        """Queue order: priority, then (``fairness: tokens``) the tenant's service, then
        arrival."""
        return (priority, self.service.get(tenant, 0.0) if self.fairness == "tokens" else 0.0,
                seq)

    def _order(self, w: _Waiter) -> tuple:
        return self._key(w.priority, w.tenant, w.seq)

    def _waiting(self) -> list[_Waiter]:
        return [w for w in self._queue if not w.future.done()]

    def _lift(self, tenant: str) -> None:
        """A tenant with nothing queued or running starts from the least counter of the
        tenants that have, so idle time earns no credit (VTC's counter lift); on an idle
        variant, from the greatest counter, so no one's history from before counts."""
        waiting = self._waiting()
        if self._running.get(tenant) or any(w.tenant == tenant for w in waiting):
            return
        active = {w.tenant for w in waiting} | {t for t, n in self._running.items() if n}
        floor = (min(self.service.get(t, 0.0) for t in active) if active
                 else max(self.service.values(), default=0.0))
        self.service[tenant] = max(self.service.get(tenant, 0.0), floor)

    def _start(self, tenant: str, cost: float, now: float, size: float = 1.0,
               priority: int = 0, top: bool = True) -> Slot:
        kept = next((k for k in self._kept if k[0] == tenant), None)
        if kept is not None:
            self._kept.remove(kept)  # it takes the slot kept for it
        # In a newcomer slot: its tenant has nothing in flight and the busy tenants' share
        # is full (else it takes a slot of that share, as any request does).
        newcomer = (self._newcomer_rule(tenant) and not self._running.get(tenant)
                    and self._newcomers < self.newcomer_slots
                    and self.in_flight - self._newcomers
                    >= self.capacity - self.newcomer_slots)
        self._newcomers += newcomer
        self.in_flight += 1
        self._running[tenant] = self._running.get(tenant, 0) + 1
        self.service[tenant] = self.service.get(tenant, 0.0) + cost
        return Slot(now, tenant, cost, size, priority=priority, top=top, newcomer=newcomer)

    def _grant(self) -> None:
        """Hand free slots to the best waiters that may use them."""
        self._prune()
        while waiting := sorted((w for w in self._waiting() if not w.held), key=self._order):
            best = waiting[0]
            if self.in_flight >= self.slots_for(best.top):
                return
            # The best waiter, else (newcomer_slots held it back) the next of its priority
            # whose tenant has nothing in flight.
            chosen = next((w for w in waiting if w.priority == best.priority
                           and self.may_start(w.top, w.tenant)), None)
            if chosen is None:
                return
            chosen.future.set_result(self._start(chosen.tenant, chosen.cost, self._clock(),
                                                 chosen.size, chosen.priority, chosen.top))
        self._prune()

    def _shed_behind(self, newcomer: _Waiter, now: float) -> None:
        """Reject queued requests of worse priority that ``newcomer`` pushes past their
        deadline."""
        if any(self._order(w) > self._order(newcomer) for w in self._waiting()):
            self._shed_late(now)

    def _shed_late(self, now: float | None = None) -> None:
        """Reject the queued requests whose estimated start is past their deadline, worst
        priority first to go."""
        now = self._clock() if now is None else now
        ahead = 0.0
        for w in sorted((w for w in self._waiting() if not w.held), key=self._order):
            if now + self._estimate(ahead + w.size,
                                    self.tenant_slots(w.top, w.tenant)) <= w.deadline:
                ahead += self._work(w)  # it stays: those behind it wait for it
            else:
                w.future.set_exception(Rejected(
                    "shed", f"variant {self.variant} is at capacity and cannot start this "
                    f"request within queue_timeout_s {self.queue_timeout_s:g} (requests of "
                    "its priority or better go first); retry later",
                    self._retry_after(self.service_s)))
        self._prune()

    def _prune(self) -> None:
        """Drop finished waiters (granted, timed out, shed, cancelled)."""
        self._queue = self._waiting()


def _granted(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
