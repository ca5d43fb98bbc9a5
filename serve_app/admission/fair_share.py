"""Tenants' shares of one variant's slots: what :mod:`serve_app.admission.variant_queue` asks
about tenants. Three rules, per variant, with ``fairness: tokens`` (the default) and named
tenants (``routes.<route>.admission`` in the router config); docs/tenants-and-adapters.md,
"Token-fair admission", shows what each buys:

- **Token-fair within a priority.** Among queued requests of one priority, the tenant with
  the least service so far goes first (FIFO within a tenant). A tenant's service is its
  virtual token counter, as in the VTC scheduler (Sheng et al., "Fairness in Serving Large
  Language Models", OSDI 2024): ``PROMPT_WEIGHT x prompt + COMPLETION_WEIGHT x completion``
  tokens *served*. A request's prompt counts when it starts, as VTC counts a request's
  input when it joins the batch (its prefill is its first step), at the prompt's bound
  until vLLM's usage gives the count; so slots granted at one moment take turns. A
  stream's completion tokens count as the router relays them, so a tenant's long streams
  count while they run; a non-stream's answer comes whole at its end, so while it runs its
  completion counts as the time it has run at the variant's measured rate
  (:meth:`~serve_app.admission.service_time.ServiceTime.tokens_per_s`, at most its
  ``max_tokens``). When a request ends, vLLM's usage replaces all of that. What a request
  *reserves* for its completion never moves a counter: a ``max_tokens`` of a whole context
  that ends after one token (or that vLLM refuses) costs its tenant what it was served,
  and no one else anything.
  A tenant that arrives with nothing queued or running has its counter lifted to the least
  counter among the tenants that have requests queued or running, so time spent idle earns
  no burst of credit; on an idle variant, to the greatest counter, so the contention of an
  hour ago (a tenant that was served a lot then, one that was away) does not decide the
  next one. ``fairness: fifo`` keeps arrival order (the baseline the fair order is
  measured against).
- **Slots for newcomers** (``newcomer_slots``, default 1). A *busy* tenant, one that holds
  an equal share of the variant's slots or more (among the tenants with requests in flight
  and one more, the next to arrive), takes no further slot once it holds ``capacity -
  newcomer_slots`` (counting those it took in newcomer slots before it was busy), and none
  of the best priority's headroom, so a *newcomer*'s request (a tenant with less: nothing
  in flight, or a light tenant with a few requests running) finds an engine slot free and
  starts at once. A request running in a newcomer slot does not count against the busy
  tenants' share: counted, it would leave one more engine slot idle while it ran. The fair
  order alone cannot do that: it decides which queued request goes next, but each waits
  for a running one to end (a long stream: many seconds), and vLLM does not preempt a
  running request to make room. The cost is ``newcomer_slots`` engine slots while only
  busy tenants run.
- **A freed slot is kept for its tenant a moment** (``anticipation_s``, default 0.05 s):
  when a request ends and its tenant would be served next (less service than every tenant
  waiting at the best priority waiting, none better than its own), its slot stays that
  tenant's for ``anticipation_s``. A client that sends its next request when the last one
  ends (most do) would otherwise lose the slot to the queue in the moment between the two
  and wait for another request to end. Anticipatory scheduling, as disks do it (Iyer and
  Druschel, "Anticipatory scheduling", SOSP 2001): a slot idles at most ``anticipation_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from serve_app.admission.slots import Slot

#: Weights of prompt and completion tokens in a tenant's service (VTC's, OSDI 2024 §4:
#: a generated token costs the engine about twice a prompt token).
PROMPT_WEIGHT, COMPLETION_WEIGHT = 1.0, 2.0


def service_cost(prompt_tokens: int, completion_tokens: int) -> float:
    """A request's weighted service, tokens."""
    return PROMPT_WEIGHT * prompt_tokens + COMPLETION_WEIGHT * completion_tokens


class FairShare:
    """The tenants' state of one variant's admission: their service counters (VTC), their
    requests in flight, those in newcomer slots, and the slots kept for them.

    Args:
        clock: ``time.monotonic`` (tests pass a fake), for :attr:`anticipation_s` and the
            service of running non-streams.
        tokens_per_s: completion tokens a second one running request is served now (the
            rate a running non-stream's service is counted at).
    """

    def __init__(self, clock, tokens_per_s: Callable[[], float] = lambda: 0.0) -> None:
        self.fairness = "tokens"
        self.newcomer_slots = 0
        self.anticipation_s = 0.0
        self.service: dict[str, float] = {}  # tenant -> service counted (VTC), but ...
        self._unrelayed: dict[str, list[Slot]] = {}  # ... its running non-streams' so far
        self.running: dict[str, int] = {}  # tenant -> slots held (only tenants holding one)
        self.in_newcomer_slots: dict[str, int] = {}  # tenant -> its slots in newcomer slots (> 0)
        self._kept: list[tuple[str, float]] = []  # (tenant, until): slots kept for it
        self._clock = clock
        self._tokens_per_s = tokens_per_s

    def configure(self, fairness: str, newcomer_slots: int, anticipation_s: float) -> None:
        self.fairness = fairness
        self.newcomer_slots = newcomer_slots
        self.anticipation_s = anticipation_s

    # -- the token-fair order ---------------------------------------------------------------

    def counter(self, tenant: str) -> float:
        """What orders ``tenant``'s requests within a priority: its service so far
        (:meth:`served_so_far`; ``fairness: tokens``), else 0 (arrival order)."""
        return self.served_so_far(tenant) if self.fairness == "tokens" else 0.0

    def served_so_far(self, tenant: str) -> float:
        """``tenant``'s service (its VTC counter), weighted tokens: what was counted, and
        what its running non-streams have been served so far at ``tokens_per_s``."""
        return self.service.get(tenant, 0.0) + sum(
            self._by_time(slot) for slot in self._unrelayed.get(tenant, ()))

    def _by_time(self, slot: Slot) -> float:
        """A running non-stream's completion so far: the time it has run at
        ``tokens_per_s``, at most its ``max_tokens`` (weighted)."""
        rate = service_cost(0, self._tokens_per_s())
        return min(slot.counts.non_stream_up_to, (self._clock() - slot.granted_at) * rate)

    def lift(self, tenant: str, waiting: set[str]) -> None:
        """A tenant with nothing queued (``waiting``: the tenants that have) or running
        starts from the least counter of the tenants that have, so idle time earns no
        credit (VTC's counter lift); on an idle variant, from the greatest counter, so no
        one's history from before counts."""
        if self.running.get(tenant) or tenant in waiting:
            return
        active = waiting | set(self.running)
        floor = (min(self.served_so_far(t) for t in active) if active
                 else max(self.service.values(), default=0.0))
        self.service[tenant] = max(self.service.get(tenant, 0.0), floor)

    def start(self, slot: Slot) -> None:
        """``slot``'s request took its slot (and any slot kept for its tenant): its prompt
        counts now (its prefill is its first step)."""
        tenant = slot.tenant
        kept = next((k for k in self._kept if k[0] == tenant), None)
        if kept is not None:
            self._kept.remove(kept)
        if slot.newcomer:
            self.in_newcomer_slots[tenant] = self.in_newcomer_slots.get(tenant, 0) + 1
        self.running[tenant] = self.running.get(tenant, 0) + 1
        if slot.counts.non_stream_up_to:
            self._unrelayed.setdefault(tenant, []).append(slot)
        self.served(slot, slot.counts.prompt)

    def served(self, slot: Slot, cost: float) -> None:
        """``slot``'s running request was served ``cost`` more (weighted tokens)."""
        slot.counted += cost
        self.service[slot.tenant] = self.service.get(slot.tenant, 0.0) + cost

    def end(self, slot: Slot, cost: float | None) -> None:
        """``slot``'s request gave its slot back; ``cost``, its real service (from vLLM's
        usage), replaces what was counted for it while it ran (None: what was counted
        stands, a non-stream's time included)."""
        tenant = slot.tenant
        if slot.newcomer:
            self.in_newcomer_slots[tenant] -= 1
            if not self.in_newcomer_slots[tenant]:
                del self.in_newcomer_slots[tenant]
        if self.running.get(tenant, 0) > 1:
            self.running[tenant] -= 1
        else:
            self.running.pop(tenant, None)
        running = self._unrelayed.get(tenant, [])
        if any(s is slot for s in running):
            if cost is None:  # how far it got is not known: what its time counted stands
                cost = slot.counted + self._by_time(slot)
            running[:] = [s for s in running if s is not slot]
        if cost is not None:
            self.served(slot, cost - slot.counted)

    # -- slots for newcomers ----------------------------------------------------------------

    @property
    def newcomers(self) -> int:
        """Slots held in newcomer slots (at most ``newcomer_slots``)."""
        return sum(self.in_newcomer_slots.values())

    def applies(self, tenant: str, capacity: int | None) -> bool:
        """Whether the newcomer rule applies to ``tenant``'s requests (a named tenant,
        ``fairness: tokens``, ``newcomer_slots`` set, the variant's capacity known)."""
        return bool(self.newcomer_slots and tenant and self.fairness == "tokens"
                    and capacity is not None)

    def newcomer(self, tenant: str, capacity: int) -> bool:
        """``tenant`` holds fewer slots than an equal share of ``capacity`` among the
        tenants with requests in flight and one more, the next to arrive (none in flight:
        the plain case; a tenant alone on the variant is a newcomer only below half)."""
        mine = self.running.get(tenant, 0)
        return not mine or mine * (len(self.running) + 1) < capacity

    def busy(self, tenant: str, capacity: int | None) -> bool:
        """The newcomer rule holds ``tenant`` to the busy tenants' share: it holds an equal
        share of the slots or more (:meth:`newcomer`)."""
        return self.applies(tenant, capacity) and not self.newcomer(tenant, capacity)

    def tenant_slots(self, slots: int, capacity: int | None, tenant: str) -> int:
        """Of ``slots``, those a request of ``tenant`` may use: all for a tenant with
        nothing in flight; the engines' (``capacity``) for one with requests in flight below
        an equal share (its next waits here, first in the fair order, rather than inside
        vLLM behind the busy tenants'); and none of the newcomer slots for a busy tenant."""
        if self.busy(tenant, capacity):
            return min(slots, max(1, capacity - self.newcomer_slots))
        if self.applies(tenant, capacity) and self.running.get(tenant):
            return min(slots, capacity)
        return slots

    def held_against(self, tenant: str, in_flight: int, capacity: int | None) -> int:
        """Of ``in_flight``, the slots that count against ``tenant``'s share: all, but for a
        busy tenant not those others hold in newcomer slots, which it may not use (else a
        newcomer running would leave one engine slot idle); its own there count (it took
        them before it was busy: counted, it holds no more than the busy share in all)."""
        if not self.busy(tenant, capacity):
            return in_flight
        return in_flight - self.newcomers + self.in_newcomer_slots.get(tenant, 0)

    @property
    def free_newcomer_slots(self) -> int:
        """Newcomer slots no request holds now."""
        return max(0, self.newcomer_slots - self.newcomers)

    def fits_newcomer_slot(self, tenant: str, capacity: int | None) -> bool:
        """Whether a request of ``tenant`` may start in a free newcomer slot (the rule
        applies, its tenant is a newcomer: :meth:`newcomer`): queued, it adds nothing to the
        wait of a busy tenant's requests behind it, which may not use that slot anyway."""
        return self.applies(tenant, capacity) and self.newcomer(tenant, capacity)

    def takes_newcomer_slot(self, tenant: str, in_flight: int, capacity: int | None) -> bool:
        """Whether a request of ``tenant`` starting now runs in a newcomer slot: its tenant
        is a newcomer (:meth:`newcomer`), one is free, and the busy tenants' share is full."""
        return (self.applies(tenant, capacity) and self.newcomer(tenant, capacity)
                and self.newcomers < self.newcomer_slots
                and in_flight - self.newcomers >= capacity - self.newcomer_slots)

    # -- a freed slot kept for its tenant ---------------------------------------------------

    def kept_for_others(self, tenant: str) -> int:
        """Slots kept now for tenants other than ``tenant``."""
        if not self._kept:
            return 0
        now = self._clock()
        self._kept = [k for k in self._kept if k[1] > now]
        return sum(1 for t, _ in self._kept if t != tenant)

    def keep(self, tenant: str, priority: int, waiting: Iterable[tuple[str, int]],
             may_use: bool, capacity: int | None, then: Callable[[], None]) -> None:
        """Keep the slot a request of ``tenant`` (at ``priority``) just freed for that
        tenant's next request, for ``anticipation_s``, when it would be served next: it has
        had less service than every tenant waiting (``waiting``: (tenant, priority) of each
        queued request) at the best priority waiting, none waiting has a better priority
        than it, none of its own requests waits (that one takes the slot at once), and it
        may use the slot (``may_use``). ``then`` runs when the keep ends."""
        if not (self.anticipation_s > 0 and tenant and self.fairness == "tokens"
                and capacity is not None):
            return
        waiting = list(waiting)
        if not waiting or not may_use or any(t == tenant for t, _ in waiting):
            return
        best = min(p for _, p in waiting)
        mine = self.served_so_far(tenant)
        if best < priority or any(self.served_so_far(t) <= mine
                                  for t in {t for t, p in waiting if p == best}):
            return
        kept = (tenant, self._clock() + self.anticipation_s)
        self._kept.append(kept)

        def expire() -> None:
            if kept in self._kept:
                self._kept.remove(kept)
            then()
        try:  # then the slot goes to the queue, whatever the clocks' rounding
            asyncio.get_running_loop().call_later(self.anticipation_s, expire)
        except RuntimeError:  # no loop (a unit test's direct call): the next decision sees it
            pass
