"""Adapter lifecycle inside one ``LLMReplica``: declared adapters, resident on first use.

*Declared* is what the variant may serve: the replica's ``user_config.adapters`` lists
``{name, version}``, specs come from the adapter registry (:mod:`serve_app.common.adapters`),
and :meth:`AdapterSet.reconcile` verifies every one without loading it (base model, rank;
for a local folder also SHA-256, target modules, no pickle). Hundreds may be declared. What
vLLM loads is the version's private copy (:mod:`serve_app.common.adapter_cache`), made from
its source (a folder, the hub, a bucket) on its first load on the node and hashed again right
before every load: a source changed after reconcile is refused, never served. *Resident* is
what this replica holds in vLLM: at most ``max_resident``
(``user_config.max_adapters_per_replica``, default the engine's ``max_cpu_loras``) adapter
versions, each loaded under its versioned LoRA name ``name@vN`` (so prefix-cache blocks of
one version are never reused for another).

- :meth:`AdapterSet.acquire` makes the request's version resident if it is not: a burst of
  requests for a cold adapter shares one load. When the replica is full, the least recently
  used resident adapter with **no request in flight** is unloaded first (Serve's own
  multiplexing LRU, checked in Ray 2.60, evicts without asking whether the model is in use);
  when every resident adapter is in use, the load waits until one is released. A request
  waits for that at most its route's ``queue_timeout_s``, then gets 503 ``adapter_capacity``
  with ``Retry-After`` (the replica is busy, not broken: no failover, nothing against a
  rollout); when every request waiting for a load has left, the load is dropped before it
  evicts anything.
- **Hand-over**: a steadily used adapter is never idle, so a load that only waited for an
  idle one would starve. Once a load has waited :data:`HANDOVER_SHARE` of its requests'
  ``queue_timeout_s``, the resident adapter in use that has held its slot longest *hands
  over*: its running requests finish, its new requests wait to load it again (and the
  replica stops reporting it resident, so the replica router sends them to another replica
  that holds it), and once its last request ends the slot is reserved for the load that
  asked. Each waiting load takes at most one slot this way, so slots rotate among the
  adapters in demand (as S-LoRA and dLoRA swap adapters by demand); no running request is
  cut.
- At ``reconcile`` the declared adapters are preloaded in config order while there is room
  without evicting anything, so a variant with a few adapters serves them all warm, as before.
- a new version of a served name takes new requests at once; requests in flight finish on the
  old one, which is unloaded when its last request ends;
- several versions of one name may be declared (an adapter version canary): the router picks
  one per caller (``route:name@vN``); a request naming no version gets the first listed;
- a removed adapter stops taking requests (404) and is unloaded once its requests end; a
  retired *version* still serves requests that name it (``name@vN``) for
  :data:`RETIRED_GRACE_S`, since the router may send one on a view a moment old (a version
  promotion, v1/v2 to v2, must give nobody a 404); unversioned requests get the new default
  at once;
- a broken adapter is refused with its reason (see :attr:`AdapterSet.refused`) and changes
  nothing else: the version that served before keeps serving.

vLLM limits: ``max_loras`` adapters can be in one batch; ``max_cpu_loras`` stay loaded in
memory, so ``max_adapters_per_replica`` may not exceed it (vLLM would otherwise evict behind
our back and reload from disk). Which replica a request for an adapter goes to is the replica
router's choice (:mod:`serve_app.replica_routing.affinity`): it prefers replicas that report the
adapter resident (:meth:`AdapterSet.resident_names`, through Serve's ``record_routing_stats``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from serve_app.common.logs import get_logger
from serve_app.common.adapters import (AdapterError, AdapterSpec, adapter_key, adapter_name,
                                       load_manifest, verify_adapter)
from serve_app.common.adapter_cache import verified_copy
from serve_app.common.errors import MeshError

logger = get_logger(__name__)

#: Events passed to ``on_event``: ``loaded`` (made resident; with its load time in s),
#: ``evicted`` (unloaded to make room), ``unloaded`` (retired and idle), ``refused``,
#: ``waited`` (a request waited for its adapter to load), ``hit`` (it was resident),
#: ``handover`` (it started handing its slot over to a waiting load).
EVENTS = ("loaded", "evicted", "unloaded", "refused", "waited", "hit", "handover")
#: Share of a waiting request's ``queue_timeout_s`` after which a resident adapter in use
#: hands its slot over (the rest of the wait covers the holder's running requests ending
#: and the load).
HANDOVER_SHARE = 0.25
#: Seconds a retired adapter version still serves requests that name it: longer than the
#: router's view of the replica's adapters takes to follow a deploy (its poll, ~1 s, and the
#: router's own reconfigure).
RETIRED_GRACE_S = 10.0
#: Longest wait for the engine to let go of an adapter's last requests before unloading it,
#: s (an abort takes one engine step).
ENGINE_DRAIN_S = 10.0
#: The error code of a request that waited ``queue_timeout_s`` for an adapter slot.
ADAPTER_CAPACITY = "adapter_capacity"
#: ``Retry-After`` of ``adapter_capacity``, s: about one request's time on a busy replica.
ADAPTER_CAPACITY_RETRY_AFTER_S = 5


@dataclass
class LiveAdapter:
    """A declared adapter version and the requests using it; ``lora_int_id`` is vLLM's id
    while it is resident (0 when not)."""

    spec: AdapterSpec
    path: Path | None  # its local source folder, checked at reconcile (None: remote)
    lora_int_id: int = 0
    in_flight: int = 0
    resident_since: float = 0.0  # monotonic s of its last load
    handover_to: str = ""  # the load key its slot goes to once its requests end ("": none)

    @property
    def lora_name(self) -> str:
        """Its name in vLLM's ``OpenAIServingModels``: ``name@vN``."""
        return self.spec.key


@dataclass
class _Load:
    """A load under way, shared by the requests waiting for it (a burst loads once)."""

    task: asyncio.Task
    live: LiveAdapter
    waiters: int = 0  # requests waiting for it
    keep: bool = False  # wanted without a waiter (reconcile's warm-up): never dropped
    loading: bool = False  # past waiting for room: vLLM is loading it
    handover_at: float = float("inf")  # monotonic s from which it may ask for a hand-over


class AdapterSet:
    """The adapters one replica may serve (declared) and holds (resident).

    Args:
        models: vLLM's ``OpenAIServingModels`` of the engine (loads/unloads LoRAs).
        engine: the ``AsyncLLM`` (frees a LoRA from its cache on unload).
        base_model: the variant's ``args.model`` (adapters must be trained for it:
            :func:`~serve_app.common.adapters.base_model_problem`).
        base_revision: the variant's ``args.revision`` (a hub model's commit).
        max_lora_rank: the engine's ``max_lora_rank``.
        max_cpu_loras: the engine's ``max_cpu_loras``: the default and the ceiling of
            ``max_resident``.
        on_event: callback ``(adapter_key, event, seconds)`` for metrics and logs; ``event``
            is one of :data:`EVENTS`, ``seconds`` the load time for ``loaded``, else None.
        clock: monotonic seconds, the clock of the event loop's timers (``loop.time``; tests
            on a virtual-time loop pass theirs).
    """

    def __init__(self, models: Any, engine: Any, *, base_model: str, max_lora_rank: int,
                 max_cpu_loras: int = 4, base_revision: str | None = None,
                 on_event: Callable[[str, str, float | None], None] = lambda *_: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.models = models
        self.clock = clock
        self.engine = engine
        self.base_model = base_model
        self.base_revision = base_revision
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.max_resident = max_cpu_loras
        self.on_event = on_event
        self.active: dict[str, LiveAdapter] = {}  # declared "name@vN" taking new requests
        self.default: dict[str, str] = {}  # adapter name -> "name@vN" for unversioned requests
        self.resident: OrderedDict[str, LiveAdapter] = OrderedDict()  # LRU first
        self.refused: dict[str, str] = {}  # "name@vN" -> reason
        self._retired_at: dict[str, tuple[LiveAdapter, float]] = {}  # key -> (it, monotonic)
        self.load_seconds: dict[str, float] = {}  # "name@vN" -> last load time, s
        self._loads: dict[str, _Load] = {}  # loads under way, by key
        self.load_errors: dict[str, str] = {}  # "name@vN" -> vLLM's last load error
        self._loading = 0  # loads under way, counted against max_resident
        self._unloading = 0  # unloads under way, still counted against max_resident
        self._reserved: set[str] = set()  # loads a handed-over slot is kept for
        self._room = asyncio.Event()  # set when an adapter is released or unloaded
        self._lock = asyncio.Lock()

    # -- reconcile ---------------------------------------------------------------------------

    async def reconcile(self, refs: list[tuple[str, int]], manifest: Path | None,
                        max_resident: int | None = None) -> None:
        """Make the declared set equal ``refs`` (``(name, version)`` pairs, in config order),
        with at most ``max_resident`` adapters resident (None: the engine's ``max_cpu_loras``).

        Several versions of one name may be served at once (an adapter version canary; the
        router picks the version per caller). Requests that name no version get the first
        listed version of the name (:meth:`acquire`).

        Never raises for a bad adapter: it is refused (reason in :attr:`refused`), the rest of
        the set is applied, and the versions of that name that served before keep serving.

        Raises:
            AdapterError: the manifest is unreadable, or ``max_resident`` is below 1 or above
                ``max_cpu_loras`` (nothing is changed).
        """
        limit = self.max_cpu_loras if max_resident is None else max_resident
        if self.max_cpu_loras and not 1 <= limit <= self.max_cpu_loras:  # 0: LoRA is off
            raise AdapterError(
                f"max_adapters_per_replica={limit} must be between 1 and the engine's "
                f"max_cpu_loras={self.max_cpu_loras}; raise engine_args.max_cpu_loras (an args "
                "change) or lower max_adapters_per_replica")
        specs = await asyncio.to_thread(load_manifest, manifest) if refs else {}
        async with self._lock:
            self.max_resident = limit
            self._room.set()  # a higher limit may let waiting loads go
            wanted = [adapter_key(name, version) for name, version in refs]
            refused_names = set()
            for key in wanted:
                if key in self.active:
                    continue
                load = self._loads.get(key)
                held = self.resident.get(key) or (load.live if load else None)
                if held is None and self._in_grace(key):
                    held = self._retired_at[key][0]
                self._retired_at.pop(key, None)
                if held is not None:  # draining or loading: take it back, one object per key
                    self.active[key] = held
                    logger.info("adapter %s serves new requests again", key)
                    continue
                try:
                    spec = specs.get(key)
                    if spec is None:
                        raise AdapterError(f"adapter {key} is not in the registry "
                                           f"{manifest or 'adapters/manifest.yaml'}; add it there")
                    path = await asyncio.to_thread(verify_adapter, spec,
                                                   base_model=self.base_model,
                                                   max_lora_rank=self.max_lora_rank,
                                                   base_revision=self.base_revision)
                except AdapterError as e:
                    refused_names.add(adapter_name(key))
                    self._refuse(key, str(e))
                    continue
                self.active[key] = LiveAdapter(spec, path)
                self.refused.pop(key, None)
                logger.info("adapter %s declared: it now takes new requests", key)
            for key in [k for k in self.active if k not in wanted]:
                if adapter_name(key) in refused_names and not any(
                        adapter_name(k) == adapter_name(key) and k in self.active for k in wanted):
                    logger.warning("adapter %s keeps serving: its replacement was refused", key)
                    continue
                live = self.active.pop(key)
                if any(adapter_name(k) == adapter_name(key) for k in self.active):
                    # another version of the name serves now: a promotion
                    self._retired_at[key] = (live, self.clock())
                    asyncio.get_running_loop().call_later(RETIRED_GRACE_S + 0.1,
                                                          self._unload_if_retired, live)
                self._unload_if_retired(live)
                logger.info("adapter %s retired: new requests no longer use it%s", key,
                            f" (requests that name it still do for {RETIRED_GRACE_S:.0f} s)"
                            if key in self._retired_at else "")
            self._trim()  # a lowered max_resident
            order = [k for k in wanted if k in self.active] + list(self.active)
            self.default = {}
            for key in order:
                self.default.setdefault(adapter_name(key), key)
            # Warm what fits without evicting anything; the rest loads on first use.
            for key in order:
                if len(self.resident) + len(self._loads) >= self.max_resident:
                    break  # (loads waiting for room count too: warming never waits or evicts)
                live = self.active.get(key)
                if live is not None and key not in self.resident and key not in self._loads:
                    try:
                        await self._load_shared(live)
                    except AdapterError:
                        continue  # refused by vLLM; _make_resident recorded why

    def _refuse(self, key: str, reason: str) -> None:
        self.refused[key] = reason
        self.on_event(key, "refused", None)
        logger.error("adapter %s refused: %s", key, reason)

    def _unload_if_retired(self, live: LiveAdapter) -> None:
        """Unload ``live`` if it is resident, no longer declared and idle (a retired adapter
        goes when its last request ends, or at once if it has none)."""
        if (live.in_flight == 0 and self.active.get(live.lora_name) is not live
                and self.resident.get(live.lora_name) is live
                and not self._in_grace(live.lora_name)):
            self._unload_soon(live, "unloaded")

    def _in_grace(self, key: str) -> bool:
        """``key`` was retired less than :data:`RETIRED_GRACE_S` ago."""
        live, at = self._retired_at.get(key, (None, float("-inf")))
        if self.clock() - at < RETIRED_GRACE_S:
            return True
        self._retired_at.pop(key, None)
        return False

    # -- residency ---------------------------------------------------------------------------

    async def _load_shared(self, live: LiveAdapter, wait_s: float | None = None,
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
            asyncio.TimeoutError: not resident within ``wait_s``.
        """
        if live.lora_name in self.resident and not live.handover_to:
            self.resident.move_to_end(live.lora_name)
            return
        load = self._loads.get(live.lora_name)
        if load is None:
            load = _Load(asyncio.ensure_future(self._make_resident(live)), live)
            self._loads[live.lora_name] = load
            load.task.add_done_callback(lambda _, mine=load: self._load_ended(mine))
        load.waiters += waiter
        load.keep = load.keep or not waiter
        if waiter and wait_s is not None:
            at = (self.clock() if asked_at is None else asked_at) + HANDOVER_SHARE * wait_s
            if at < load.handover_at:
                load.handover_at = at
                self._room.set()  # its wait for room now has a deadline to wake at
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
                if self._loads.get(live.lora_name) is load:  # the next request loads anew
                    del self._loads[live.lora_name]
                self._forget_handover(live.lora_name, "was dropped")  # before a release

    def _load_ended(self, load: _Load) -> None:
        """``load`` is over: it leaves ``_loads`` (unless a newer load of the version took
        its place), and its failure, logged by :meth:`_load` and raised to its waiters, is
        not logged again by asyncio when it had none left."""
        if self._loads.get(load.live.lora_name) is load:
            del self._loads[load.live.lora_name]
        if not load.task.cancelled():
            load.task.exception()

    def _has_room(self, key: str) -> bool:
        """A load of ``key`` fits now: resident adapters, loads and unloads under way, and
        slots kept for other loads leave one of ``max_resident``."""
        taken = (len(self.resident) + self._loading + self._unloading
                 + len(self._reserved - {key}))
        return taken < self.max_resident

    async def _make_resident(self, live: LiveAdapter) -> None:
        key = live.lora_name
        due = False  # its wait for room ran to its hand-over time
        try:
            while not self._has_room(key):
                victim = next((a for a in self.resident.values() if a.in_flight == 0), None)
                if victim is not None:
                    try:
                        await asyncio.shield(self._unload(victim, "evicted"))  # once begun, ends
                    except Exception as e:  # noqa: BLE001 -- it left `resident` already; go on
                        logger.error("adapter %s: unload failed: %s", victim.lora_name, e)
                    continue
                # Every resident adapter is in use (or its slot is kept for another load):
                # wait for a release, asking for a hand-over once this load has waited long
                # enough.
                load = self._loads.get(key)
                handover_at = load.handover_at if load is not None else float("inf")
                if due or self.clock() >= handover_at:
                    self._ask_handover(key)
                    handover_at = float("inf")
                self._room.clear()
                timeout = handover_at - self.clock()
                try:
                    # timeout, not wait_for: on Python 3.11 wait_for may swallow the
                    # cancellation of a dropped load as room comes, and the load went on
                    async with asyncio.timeout(None if timeout == float("inf")
                                               else max(timeout, 0)):
                        await self._room.wait()
                    due = False
                except TimeoutError:
                    due = True  # (the loop fires a timer up to its clock resolution early)
        except BaseException:
            self._forget_handover(key, "was dropped")
            raise
        # It found room (a slot handed over, or another way): no slot is kept for it any
        # more, and an adapter still handing over to it keeps its slot.
        self._forget_handover(key, "found room elsewhere")
        load = self._loads.get(key)
        if load is not None:
            load.loading = True  # from here on, vLLM loads it for whoever comes next
        self._loading += 1
        try:
            await self._load(live)
        finally:
            self._loading -= 1
            self._room.set()
        self._unload_if_retired(live)  # retired while it loaded, and nobody waits

    def _ask_handover(self, key: str) -> None:
        """The load of ``key`` waited its share: the resident adapter in use that has held
        its slot longest (and is not handing over already) hands it over to it. One
        hand-over per waiting load."""
        if key in self._reserved or any(a.handover_to == key for a in self.resident.values()):
            return
        holders = [a for a in self.resident.values() if not a.handover_to]
        if not holders:
            return  # every slot is being handed over already: wait for one to free
        victim = min(holders, key=lambda a: a.resident_since)
        victim.handover_to = key
        self.on_event(victim.lora_name, "handover", None)
        logger.info("adapter %s hands its slot over to %s: its %d running request(s) finish, "
                    "its new ones wait to load it again", victim.lora_name, key,
                    victim.in_flight)
        if victim.in_flight == 0:
            self._unload_soon(victim, "evicted")

    def _forget_handover(self, key: str, why: str) -> None:
        """The load of ``key`` left its wait for room (it found room, was dropped, or
        failed): the slot kept for it is free again, and an adapter still handing over to it
        keeps its slot, is reported resident again, and its waiting requests go on (``why``
        ends the log line)."""
        self._reserved.discard(key)
        for a in self.resident.values():
            if a.handover_to == key:
                a.handover_to = ""
                logger.info("adapter %s keeps its slot: the load it was handing over to "
                            "(%s) %s", a.lora_name, key, why)
        self._room.set()

    async def _load(self, live: LiveAdapter) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        t0 = self.clock()
        try:  # what vLLM reads is the private copy, hashed again right now (every load)
            path = await asyncio.to_thread(verified_copy, live.spec)
        except AdapterError as e:
            result, reason = None, str(e)
        else:
            result = await self.models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=live.lora_name, lora_path=str(path)))
            reason = (f"vLLM could not load adapter {live.lora_name}: {result.error.message}"
                      if isinstance(result, ErrorResponse) else "")
        if reason:
            # Declared stays declared (the variant's adapter list must not differ between its
            # replicas): this request fails over (503), the next one tries the load again.
            self.load_errors[live.lora_name] = reason
            self.on_event(live.lora_name, "refused", None)
            logger.error("adapter %s: %s", live.lora_name, reason)
            raise AdapterError(reason)
        self.load_errors.pop(live.lora_name, None)
        live.lora_int_id = self.models.lora_requests[live.lora_name].lora_int_id
        self.resident[live.lora_name] = live
        live.resident_since = self.clock()
        seconds = self.clock() - t0
        self.load_seconds[live.lora_name] = seconds
        self.on_event(live.lora_name, "loaded", seconds)
        logger.info("adapter %s resident (%.2f s; %d of %d resident)", live.lora_name,
                    seconds, len(self.resident), self.max_resident)

    def _unload_soon(self, live: LiveAdapter, event: str) -> None:
        """:meth:`_unload` in the background; ``live`` leaves ``resident`` now."""
        lora_int_id = self._take_out(live)
        if lora_int_id is not None:
            asyncio.get_running_loop().create_task(self._unload_taken(live, lora_int_id, event))

    async def _unload(self, live: LiveAdapter, event: str) -> None:
        """Unload ``live`` from vLLM (``event``: ``evicted`` or ``unloaded``)."""
        lora_int_id = self._take_out(live)
        if lora_int_id is not None:
            await self._unload_taken(live, lora_int_id, event)

    def _take_out(self, live: LiveAdapter) -> int | None:
        """Take ``live`` out of ``resident`` (its slot stays counted until vLLM has let it
        go) and return its LoRA id; None if it is gone already or in use again."""
        if self.resident.get(live.lora_name) is not live or live.in_flight:
            return None
        del self.resident[live.lora_name]  # before any await: no second unload
        lora_int_id, live.lora_int_id = live.lora_int_id, 0
        if live.handover_to:  # the slot is kept for the load it was handed over to
            load = self._loads.get(live.handover_to)
            if load is not None and not (load.loading or load.task.done()):  # still waits
                self._reserved.add(live.handover_to)
            live.handover_to = ""
        self._unloading += 1
        return lora_int_id

    async def _unload_taken(self, live: LiveAdapter, lora_int_id: int, event: str) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        try:
            await self._engine_done_with(live.lora_name)
            await self.models.unload_lora_adapter(
                UnloadLoRAAdapterRequest(lora_name=live.lora_name))
            await self.engine.remove_lora(lora_int_id)
        finally:
            self._unloading -= 1
            self._room.set()
        self.on_event(live.lora_name, event, None)
        logger.info("adapter %s %s (%d of %d resident)", live.lora_name, event,
                    len(self.resident), self.max_resident)

    def _trim(self) -> None:
        """Unload idle resident adapters past ``max_resident``, least recently used first: a
        lowered bound holds at once for the idle ones, and for one in use when its last
        request ends."""
        for live in list(self.resident.values()):
            if len(self.resident) <= self.max_resident:
                return
            if live.in_flight == 0:
                self._unload_soon(live, "evicted")

    def _engine_requests_on(self, lora_name: str) -> int:
        """Requests the engine itself still holds on ``lora_name`` (its output processor's
        states; a request our side has let go of is aborted a moment later)."""
        states = getattr(getattr(self.engine, "output_processor", None), "request_states", {})
        return sum(1 for r in list(states.values()) if getattr(r, "lora_name", None) == lora_name)

    async def _engine_done_with(self, lora_name: str) -> None:
        """Wait until the engine holds no request on ``lora_name`` (at most
        :data:`ENGINE_DRAIN_S`): a request whose client left is released here before vLLM
        has aborted it, and its adapter must not be removed under it."""
        deadline = self.clock() + ENGINE_DRAIN_S
        while (n := self._engine_requests_on(lora_name)) and self.clock() < deadline:
            await asyncio.sleep(0.01)
        if n:
            logger.warning("adapter %s: the engine still holds %d request(s) on it after %.0f "
                           "s; unloading it anyway", lora_name, n, ENGINE_DRAIN_S)

    # -- requests ----------------------------------------------------------------------------

    async def acquire(self, adapter: str, wait_s: float | None = None) -> LiveAdapter:
        """The version that takes this request, made resident; count the request on it.

        Args:
            adapter: ``name@vN`` for one version, or ``name`` for its default version (the
                first one listed in the config).
            wait_s: longest wait for room to load it, s (the route's ``queue_timeout_s``;
                None: no bound).

        Raises:
            MeshError: 404 if this variant does not declare it; 503 ``adapter_capacity``
                with ``Retry-After`` if every resident adapter stayed in use for ``wait_s``
                (the replica is busy); 503 ``adapter_load_failed`` (a variant failure) if
                the load failed (vLLM's reason in :attr:`load_errors`; the next request tries
                again).
        """
        live = self.active.get(self.default.get(adapter, adapter))
        if live is None and self._in_grace(adapter):
            live = self._retired_at[adapter][0]  # the router's view is a moment old
        if live is None:
            raise MeshError(404, f"adapter {adapter!r} is not served by this variant",
                            param="model", code="adapter_not_found")
        asked_at = self.clock()
        counted = not live.handover_to  # waiting out a hand-over, it counts once the slot went
        if counted:
            live.in_flight += 1  # before any await: an adapter in use is never evicted
            if self.resident.get(live.lora_name) is live:
                self.resident.move_to_end(live.lora_name)
                self.on_event(live.lora_name, "hit", None)
                return live
        self.on_event(live.lora_name, "waited", None)
        try:
            if not counted:  # it is handing its slot over: wait, then load it again
                async with asyncio.timeout(wait_s):  # (not wait_for: see _load_shared)
                    await self._gone(live)
                live.in_flight += 1
                counted = True
            remaining = None if wait_s is None else max(wait_s - (self.clock() - asked_at), 0)
            await self._load_shared(live, remaining, waiter=True, asked_at=asked_at)
        except asyncio.TimeoutError:
            if counted:
                self.release(live)
            raise MeshError(503, f"adapter {live.lora_name} could not be loaded within "
                            f"queue_timeout_s {wait_s:g}: this replica's "
                            f"{self.max_resident} adapter slot(s) (max_adapters_per_replica) "
                            f"stayed in use by other adapters' requests; retry later",
                            code=ADAPTER_CAPACITY, headers={
                                "Retry-After": str(ADAPTER_CAPACITY_RETRY_AFTER_S)}) from None
        except BaseException as e:
            if counted:
                self.release(live)
            if isinstance(e, Exception):  # not a cancellation: the variant's fault, fail over
                raise MeshError(503, f"adapter {live.lora_name} could not be loaded: {e}",
                                code="adapter_load_failed") from None
            raise
        return live

    async def _gone(self, live: LiveAdapter) -> None:
        """Until ``live`` has handed its slot over (it is no longer resident, or its
        hand-over was called off)."""
        while self.resident.get(live.lora_name) is live and live.handover_to:
            self._room.clear()
            await self._room.wait()

    def release(self, live: LiveAdapter) -> None:
        """A request on ``live`` ended; unload it if it is retired and now idle."""
        live.in_flight -= 1
        if live.in_flight == 0:
            self._room.set()
            if live.handover_to and self.resident.get(live.lora_name) is live:
                self._unload_soon(live, "evicted")  # its last request ended: hand over
            else:
                self._unload_if_retired(live)
                self._trim()

    def serving(self) -> list[str]:
        """Versions that take requests: the declared ones, and retired ones within their
        grace (requests that name them)."""
        return [*self.active, *(k for k in list(self._retired_at) if self._in_grace(k))]

    def resident_names(self) -> list[str]:
        """Resident adapter versions (``name@vN``) that take new requests, least recently
        used first: one handing its slot over is left out, so the replica router sends its
        new requests to a replica that holds it."""
        return [k for k, a in self.resident.items() if not a.handover_to]

    def ready(self, adapter: str) -> bool:
        """A request for ``adapter`` (``name`` or ``name@vN``) would start without waiting
        for a load (it is resident and not handing its slot over)."""
        live = self.active.get(self.default.get(adapter, adapter))
        return live is not None and self.resident.get(live.lora_name) is live \
            and not live.handover_to

    def status(self) -> dict[str, Any]:
        """Declared (``active``), draining (``retiring``), ``resident`` (LRU first) and refused
        adapters, and the load times (s), for the admin endpoint."""
        return {
            "active": {k: {"in_flight": a.in_flight, "default": k in self.default.values(),
                           "resident": k in self.resident}
                       for k, a in self.active.items()},
            "retiring": {k: {"in_flight": a.in_flight} for k, a in self.resident.items()
                         if k not in self.active},
            "resident": list(self.resident),
            "max_resident": self.max_resident,
            "refused": dict(self.refused),
            "load_errors": dict(self.load_errors),
            "load_seconds": {k: round(v, 3) for k, v in self.load_seconds.items()},
        }
