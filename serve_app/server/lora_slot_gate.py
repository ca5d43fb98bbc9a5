"""Room for adapter loads in one replica: loads wait for a slot, and slots are handed over.

- A load makes its adapter resident (:class:`~serve_app.server.lora_residency.Residency`) once
  it fits: resident adapters, loads and unloads under way, and slots kept for other loads leave
  one of ``max_resident``. A burst of requests for a cold adapter shares one load. When the
  replica is full, the least recently used resident adapter with **no request in flight** is
  unloaded first (Serve's own multiplexing LRU, checked in Ray 2.60, evicts without asking
  whether the model is in use); when every resident adapter is in use, the load waits until
  one is released. When every request waiting for a load has left, the load is dropped before
  it evicts anything.
- **Hand-over**: a steadily used adapter is never idle, so a load that only waited for an idle
  one would starve. Once a load has waited :data:`HANDOVER_SHARE` of its requests'
  ``queue_timeout_s``, the resident adapter in use that has held its slot longest *hands
  over*: its running requests finish, its new requests wait to load it again (and the replica
  stops reporting it resident, so the replica router sends them to another replica that holds
  it), and once its last request ends the slot is reserved for the load that asked. Each
  waiting load takes at most one slot this way, so slots rotate among the adapters in demand
  (as S-LoRA and dLoRA swap adapters by demand); no running request is cut.
- A load that leaves its wait for room (it found room, was dropped, or failed) takes its marks
  along: the slot reserved for it is free again, and an adapter still handing over to it keeps
  its slot and serves its new requests at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from serve_app.common.logs import get_logger
from serve_app.server.lora_residency import LiveAdapter, Residency

logger = get_logger(__name__)

#: Share of a waiting request's ``queue_timeout_s`` after which a resident adapter in use
#: hands its slot over (the rest of the wait covers the holder's running requests ending
#: and the load).
HANDOVER_SHARE = 0.25


@dataclass
class Load:
    """A load under way, shared by the requests waiting for it (a burst loads once)."""

    task: asyncio.Task
    live: LiveAdapter
    waiters: int = 0  # requests waiting for it
    keep: bool = False  # wanted without a waiter (reconcile's warm-up): never dropped
    loading: bool = False  # past waiting for room: vLLM is loading it
    handover_at: float = float("inf")  # monotonic s from which it may ask for a hand-over


class SlotGate:
    """The loads of one replica's adapters and the slots they wait for.

    Args:
        residency: the resident adapters (its ``max_resident`` bounds the slots).
        clock: monotonic s, the clock of the event loop's timers.
        on_event: ``(adapter_key, "handover", None)`` when an adapter starts handing its
            slot over.

    ``loads`` (by ``name@vN``), ``reserved`` (loads a handed-over slot is kept for) and
    ``loading`` (loads past their wait) are read by others, changed here only.
    """

    def __init__(self, residency: Residency, *, clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[str, str, float | None], None] = lambda *_: None) -> None:
        self.residency = residency
        self.clock = clock
        self.on_event = on_event
        self.loads: dict[str, Load] = {}  # loads under way, by key
        self.reserved: set[str] = set()  # loads a handed-over slot is kept for
        self.loading = 0  # loads vLLM runs, counted against max_resident
        #: Called once a load has ended in vLLM (the reconciler unloads a version retired
        #: meanwhile that nobody waits for).
        self.after_load: Callable[[LiveAdapter], None] = lambda live: None

    async def make_resident(self, live: LiveAdapter, wait_s: float | None = None,
                            waiter: bool = False, asked_at: float | None = None) -> None:
        """Make ``live`` resident; concurrent callers share one load.

        Args:
            wait_s: longest wait, s (None: no bound).
            waiter: a request waits for it: when every waiter has left (timed out, client
                gone) while the load still waits for room, the load is dropped. A waiter
                with a bounded wait lets the load ask for a hand-over once it has waited
                :data:`HANDOVER_SHARE` of ``wait_s`` since ``asked_at``.
            asked_at: monotonic s the request began to wait (default: now).

        Raises:
            TimeoutError: not resident within ``wait_s``.
            AdapterError: the load failed (:meth:`Residency.load`).
        """
        resident = self.residency.resident
        if live.lora_name in resident and not live.handover_to:
            resident.move_to_end(live.lora_name)
            return
        load = self.loads.get(live.lora_name)
        if load is None:
            load = Load(asyncio.ensure_future(self._load_when_room(live)), live)
            self.loads[live.lora_name] = load
            load.task.add_done_callback(lambda _, mine=load: self._load_ended(mine))
        load.waiters += waiter
        load.keep = load.keep or not waiter
        if waiter and wait_s is not None:
            at = (self.clock() if asked_at is None else asked_at) + HANDOVER_SHARE * wait_s
            if at < load.handover_at:
                load.handover_at = at
                self.residency.room.set()  # its wait for room now has a deadline to wake at
        try:
            # shield: a caller that leaves does not cancel the others' load; timeout, not
            # wait_for: on Python 3.11 wait_for may swallow the cancellation of a caller
            # that leaves as the load ends, and the request went on without its client
            async with asyncio.timeout(wait_s):
                await asyncio.shield(load.task)
        finally:
            load.waiters -= waiter
            if waiter and not (load.waiters or load.keep or load.loading or load.task.done()):
                logger.info("adapter %s: every request waiting for it left; its load is "
                            "dropped before it evicts anything", live.lora_name)
                load.task.cancel()
                if self.loads.get(live.lora_name) is load:  # the next request loads anew
                    del self.loads[live.lora_name]
                self._forget_handover(live.lora_name, "was dropped")  # before a release

    def _load_ended(self, load: Load) -> None:
        """``load`` is over: it leaves ``loads`` (unless a newer load of the version took its
        place), and its failure, logged by :meth:`Residency.load` and raised to its waiters,
        is not logged again by asyncio when it had none left."""
        if self.loads.get(load.live.lora_name) is load:
            del self.loads[load.live.lora_name]
        if not load.task.cancelled():
            load.task.exception()

    def _has_room(self, key: str) -> bool:
        """A load of ``key`` fits now: resident adapters, loads and unloads under way, and
        slots kept for other loads leave one of ``max_resident``."""
        r = self.residency
        taken = len(r.resident) + self.loading + r.unloading + len(self.reserved - {key})
        return taken < r.max_resident

    async def _load_when_room(self, live: LiveAdapter) -> None:
        key, residency = live.lora_name, self.residency
        due = False  # its wait for room ran to its hand-over time
        try:
            while not self._has_room(key):
                victim = next((a for a in residency.resident.values() if a.in_flight == 0), None)
                if victim is not None:
                    try:
                        await asyncio.shield(residency.unload(victim, "evicted"))  # it ends
                    except Exception as e:  # noqa: BLE001 -- it left `resident` already; go on
                        logger.error("adapter %s: unload failed: %s", victim.lora_name, e)
                    continue
                # Every resident adapter is in use (or its slot is kept for another load):
                # wait for a release, asking for a hand-over once this load has waited long
                # enough.
                load = self.loads.get(key)
                handover_at = load.handover_at if load is not None else float("inf")
                if due or self.clock() >= handover_at:
                    self._ask_handover(key)
                    handover_at = float("inf")
                residency.room.clear()
                timeout = handover_at - self.clock()
                try:
                    # timeout, not wait_for: on Python 3.11 wait_for may swallow the
                    # cancellation of a dropped load as room comes, and the load went on
                    async with asyncio.timeout(None if timeout == float("inf")
                                               else max(timeout, 0)):
                        await residency.room.wait()
                    due = False
                except TimeoutError:
                    due = True  # (the loop fires a timer up to its clock resolution early)
        except BaseException:
            self._forget_handover(key, "was dropped")
            raise
        # It found room (a slot handed over, or another way): no slot is kept for it any
        # more, and an adapter still handing over to it keeps its slot.
        self._forget_handover(key, "found room elsewhere")
        load = self.loads.get(key)
        if load is not None:
            load.loading = True  # from here on, vLLM loads it for whoever comes next
        self.loading += 1
        try:
            await residency.load(live)
        finally:
            self.loading -= 1
            residency.room.set()
        self.after_load(live)

    def _ask_handover(self, key: str) -> None:
        """The load of ``key`` waited its share: the resident adapter in use that has held
        its slot longest (and is not handing over already) hands it over to it. One
        hand-over per waiting load."""
        resident = self.residency.resident
        if key in self.reserved or any(a.handover_to == key for a in resident.values()):
            return
        holders = [a for a in resident.values() if not a.handover_to]
        if not holders:
            return  # every slot is being handed over already: wait for one to free
        victim = min(holders, key=lambda a: a.resident_since)
        victim.handover_to = key
        self.on_event(victim.lora_name, "handover", None)
        logger.info("adapter %s hands its slot over to %s: its %d running request(s) finish, "
                    "its new ones wait to load it again", victim.lora_name, key,
                    victim.in_flight)
        if victim.in_flight == 0:
            self.residency.unload_soon(victim, "evicted")

    def _forget_handover(self, key: str, why: str) -> None:
        """The load of ``key`` left its wait for room (it found room, was dropped, or
        failed): the slot kept for it is free again, and an adapter still handing over to it
        keeps its slot, is reported resident again, and its waiting requests go on (``why``
        ends the log line)."""
        self.reserved.discard(key)
        for a in self.residency.resident.values():
            if a.handover_to == key:
                a.handover_to = ""
                logger.info("adapter %s keeps its slot: the load it was handing over to "
                            "(%s) %s", a.lora_name, key, why)
        self.residency.room.set()

    def left_resident(self, live: LiveAdapter) -> None:
        """``live`` left ``resident`` (:attr:`Residency.on_leave`): a slot it was handing
        over is kept for the load it was handed to, if that load still waits for room."""
        if live.handover_to:
            load = self.loads.get(live.handover_to)
            if load is not None and not (load.loading or load.task.done()):
                self.reserved.add(live.handover_to)
            live.handover_to = ""

    async def until_handed_over(self, live: LiveAdapter) -> None:
        """Until ``live`` has handed its slot over (it is no longer resident, or its
        hand-over was called off)."""
        while self.residency.holds(live) and live.handover_to:
            self.residency.room.clear()
            await self.residency.room.wait()
