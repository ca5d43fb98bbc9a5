"""Adapter lifecycle inside one ``LLMReplica``: declared adapters, resident on first use.

:class:`AdapterSet` is what the replica uses; three parts do the work, one concept each:

- *declared* (:mod:`serve_app.server.lora_reconcile`): what the variant may serve, from
  ``user_config.adapters`` and the adapter registry, verified without loading; versions
  promoted, retired (with a grace for requests that name them) and refused;
- *resident* (:mod:`serve_app.server.lora_residency`): what this replica holds in vLLM, at most
  ``max_resident`` (``user_config.max_adapters_per_replica``, default the engine's
  ``max_cpu_loras``) versions, each under its LoRA name ``name@vN``, loaded from a private
  copy hashed again before every load, unloaded once the engine holds no request on it;
- *slots* (:mod:`serve_app.server.lora_slot_gate`): a load waits for room, evicts the least
  recently used idle adapter, and after :data:`HANDOVER_SHARE` of its wait has an adapter in
  use hand its slot over, so no adapter in demand starves.

:meth:`AdapterSet.acquire` makes the request's version resident if it is not: a burst of
requests for a cold adapter shares one load, and an adapter in use is never evicted. A request
waits for a slot at most its route's ``queue_timeout_s``, then gets 503 ``adapter_capacity``
with ``Retry-After`` (the replica is busy, not broken: no failover, nothing against a
rollout); a failed load is 503 ``adapter_load_failed`` (a variant failure: the router fails
over). Which replica a request for an adapter goes to is the replica router's choice
(:mod:`serve_app.replica_routing.affinity`): it prefers replicas that report the adapter
resident (:meth:`AdapterSet.resident_names`, through Serve's ``record_routing_stats``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from serve_app.common.errors import MeshError
from serve_app.server.lora_reconcile import RETIRED_GRACE_S, AdapterReconciler
from serve_app.server.lora_residency import ENGINE_DRAIN_S, LiveAdapter, Residency
from serve_app.server.lora_slot_gate import HANDOVER_SHARE, SlotGate

__all__ = ["ADAPTER_CAPACITY", "ADAPTER_CAPACITY_RETRY_AFTER_S", "ENGINE_DRAIN_S", "EVENTS",
           "HANDOVER_SHARE", "RETIRED_GRACE_S", "AdapterSet", "LiveAdapter"]

#: Events passed to ``on_event``: ``loaded`` (made resident; with its load time in s),
#: ``evicted`` (unloaded to make room), ``unloaded`` (retired and idle), ``refused``,
#: ``waited`` (a request waited for its adapter to load), ``hit`` (it was resident),
#: ``handover`` (it started handing its slot over to a waiting load).
EVENTS = ("loaded", "evicted", "unloaded", "refused", "waited", "hit", "handover")
#: The error code of a request that waited ``queue_timeout_s`` for an adapter slot.
ADAPTER_CAPACITY = "adapter_capacity"
#: ``Retry-After`` of ``adapter_capacity``, s: about one request's time on a busy replica.
ADAPTER_CAPACITY_RETRY_AFTER_S = 5


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
            It may be replaced after construction.
        clock: monotonic seconds, the clock of the event loop's timers (``loop.time``; tests
            on a virtual-time loop pass theirs).
    """

    def __init__(self, models: Any, engine: Any, *, base_model: str, max_lora_rank: int,
                 max_cpu_loras: int = 4, base_revision: str | None = None,
                 on_event: Callable[[str, str, float | None], None] = lambda *_: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.models = models
        self.engine = engine
        self.max_cpu_loras = max_cpu_loras
        self.on_event = on_event
        self.clock = clock
        event = self._event  # (the parts call the on_event of the moment)
        self.residency = Residency(models, engine, max_resident=max_cpu_loras, clock=clock,
                                   on_event=event)
        self.slots = SlotGate(self.residency, clock=clock, on_event=event)
        self.declared = AdapterReconciler(
            self.residency, self.slots, base_model=base_model, base_revision=base_revision,
            max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras, clock=clock,
            on_event=event)
        self.residency.on_leave = self.slots.left_resident
        self.slots.after_load = self.declared.unload_if_retired

    def _event(self, key: str, event: str, seconds: float | None) -> None:
        self.on_event(key, event, seconds)

    # -- what the replica reads --------------------------------------------------------------

    @property
    def active(self) -> dict[str, LiveAdapter]:
        """Declared versions (``name@vN``) taking new requests."""
        return self.declared.active

    @property
    def default(self) -> dict[str, str]:
        """Adapter name -> the version (``name@vN``) unversioned requests get."""
        return self.declared.default

    @property
    def refused(self) -> dict[str, str]:
        """``name@vN`` -> why reconcile refused it."""
        return self.declared.refused

    @property
    def resident(self) -> OrderedDict[str, LiveAdapter]:
        """Resident versions, least recently used first."""
        return self.residency.resident

    @property
    def load_errors(self) -> dict[str, str]:
        """``name@vN`` -> vLLM's last load error (until a load of it succeeds)."""
        return self.residency.load_errors

    @property
    def load_seconds(self) -> dict[str, float]:
        """``name@vN`` -> its last load time, s."""
        return self.residency.load_seconds

    @property
    def max_resident(self) -> int:
        """The bound on resident versions (``max_adapters_per_replica``)."""
        return self.residency.max_resident

    @max_resident.setter
    def max_resident(self, value: int) -> None:
        self.residency.max_resident = value

    # -- reconcile and requests ----------------------------------------------------------------

    async def reconcile(self, refs: list[tuple[str, int]], manifest: Path | None,
                        max_resident: int | None = None) -> None:
        """Make the declared set equal ``refs`` (``(name, version)`` pairs, in config order),
        with at most ``max_resident`` adapters resident (None: the engine's ``max_cpu_loras``):
        :meth:`AdapterReconciler.reconcile`. Requests that name no version get the first
        listed version of the name (:meth:`acquire`).

        Raises:
            AdapterError: the manifest is unreadable, or ``max_resident`` is below 1 or above
                ``max_cpu_loras`` (nothing is changed). A bad adapter is refused on its own
                (:attr:`refused`), never raised.
        """
        await self.declared.reconcile(refs, manifest, max_resident)

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
        live = self.declared.version_for(adapter)
        if live is None:
            raise MeshError(404, f"adapter {adapter!r} is not served by this variant",
                            param="model", code="adapter_not_found")
        asked_at = self.clock()
        counted = not live.handover_to  # waiting out a hand-over, it counts once the slot went
        if counted:
            live.in_flight += 1  # before any await: an adapter in use is never evicted
            if self.residency.holds(live):
                self.resident.move_to_end(live.lora_name)
                self.on_event(live.lora_name, "hit", None)
                return live
        self.on_event(live.lora_name, "waited", None)
        try:
            if not counted:  # it is handing its slot over: wait, then load it again
                async with asyncio.timeout(wait_s):  # (not wait_for: see SlotGate)
                    await self.slots.until_handed_over(live)
                live.in_flight += 1
                counted = True
            remaining = None if wait_s is None else max(wait_s - (self.clock() - asked_at), 0)
            await self.slots.make_resident(live, remaining, waiter=True, asked_at=asked_at)
        except TimeoutError:
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

    def release(self, live: LiveAdapter) -> None:
        """A request on ``live`` ended; unload it if it is retired and now idle, or hand its
        slot over if it was handing over."""
        live.in_flight -= 1
        if live.in_flight == 0:
            self.residency.room.set()
            if live.handover_to and self.residency.holds(live):
                self.residency.unload_soon(live, "evicted")  # its last request ended: hand over
            else:
                self.declared.unload_if_retired(live)
                self.residency.trim()

    def serving(self) -> list[str]:
        """Versions that take requests: the declared ones, and retired ones within their
        grace (requests that name them)."""
        return self.declared.serving()

    def resident_names(self) -> list[str]:
        """Resident adapter versions (``name@vN``) that take new requests, least recently
        used first: one handing its slot over is left out, so the replica router sends its
        new requests to a replica that holds it."""
        return [k for k, a in self.resident.items() if not a.handover_to]

    def ready(self, adapter: str) -> bool:
        """A request for ``adapter`` (``name`` or ``name@vN``) would start without waiting
        for a load (it is resident and not handing its slot over)."""
        live = self.active.get(self.default.get(adapter, adapter))
        return live is not None and self.residency.holds(live) and not live.handover_to

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
