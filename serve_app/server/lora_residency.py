"""The adapter versions one replica holds in vLLM (*resident*), and the loads and unloads that
change them.

At most ``max_resident`` (``user_config.max_adapters_per_replica``, default the engine's
``max_cpu_loras``) adapter versions are resident, least recently used first, each loaded under
its versioned LoRA name ``name@vN`` (so prefix-cache blocks of one version are never reused
for another). What vLLM loads is the version's private copy
(:mod:`serve_app.common.adapter_cache`), made from its source (a folder, the hub, a bucket) on
its first load on the node and hashed again right before every load: a source changed after
reconcile is refused, never served. An adapter in use is never unloaded; one taken out of
``resident`` still counts against ``max_resident`` until vLLM has let it go, and is removed
from the engine only once the engine holds no request on it.

vLLM limits: ``max_cpu_loras`` adapters stay loaded in memory, so ``max_resident`` may not
exceed it (vLLM would otherwise evict behind our back and reload from disk). Which adapter
makes room for a load, and when, is the slot gate's call (:mod:`serve_app.server.lora_slot_gate`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from serve_app.common.adapter_cache import verified_copy
from serve_app.common.adapters import AdapterError, AdapterSpec
from serve_app.common.logs import get_logger

logger = get_logger(__name__)

#: Longest wait for the engine to let go of an adapter's last requests before unloading it,
#: s (an abort takes one engine step).
ENGINE_DRAIN_S = 10.0


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


class Residency:
    """The resident adapters of one replica and their loads and unloads in vLLM.

    Args:
        models: vLLM's ``OpenAIServingModels`` of the engine (loads/unloads LoRAs).
        engine: the ``AsyncLLM`` (frees a LoRA from its cache on unload; its output
            processor holds the requests still on an adapter).
        max_resident: the bound on resident adapters (:attr:`max_resident`; reconcile sets it).
        clock: monotonic s, the clock of the event loop's timers.
        on_event: ``(adapter_key, event, seconds)``: ``loaded`` (with its load time, s),
            ``evicted``, ``unloaded`` or ``refused`` (vLLM refused the load; seconds None).
    """

    def __init__(self, models: Any, engine: Any, *, max_resident: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[str, str, float | None], None] = lambda *_: None) -> None:
        self.models = models
        self.engine = engine
        self.max_resident = max_resident
        self.clock = clock
        self.on_event = on_event
        self.resident: OrderedDict[str, LiveAdapter] = OrderedDict()  # LRU first
        self.load_seconds: dict[str, float] = {}  # "name@vN" -> last load time, s
        self.load_errors: dict[str, str] = {}  # "name@vN" -> vLLM's last load error
        self.unloading = 0  # unloads under way, still counted against max_resident
        #: Set when a slot may have come free, or a wait for one has new terms.
        self.room = asyncio.Event()
        #: Called as an adapter leaves ``resident`` (the slot gate passes a handed-over slot
        #: on to the load it was handed over to).
        self.on_leave: Callable[[LiveAdapter], None] = lambda live: None

    def holds(self, live: LiveAdapter) -> bool:
        """``live`` (this very version object) is resident."""
        return self.resident.get(live.lora_name) is live

    async def load(self, live: LiveAdapter) -> None:
        """Load ``live`` into vLLM from its private copy and make it resident (the caller
        has made room).

        Raises:
            AdapterError: the copy failed its check, or vLLM refused the adapter (the reason
                is in :attr:`load_errors` until a load of it succeeds).
        """
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

    def unload_soon(self, live: LiveAdapter, event: str) -> None:
        """:meth:`unload` in the background; ``live`` leaves ``resident`` now."""
        lora_int_id = self._take_out(live)
        if lora_int_id is not None:
            asyncio.get_running_loop().create_task(self._unload_taken(live, lora_int_id, event))

    async def unload(self, live: LiveAdapter, event: str) -> None:
        """Unload ``live`` from vLLM (``event``: ``evicted`` or ``unloaded``); nothing if it
        is not resident or is in use."""
        lora_int_id = self._take_out(live)
        if lora_int_id is not None:
            await self._unload_taken(live, lora_int_id, event)

    def _take_out(self, live: LiveAdapter) -> int | None:
        """Take ``live`` out of ``resident`` (its slot stays counted until vLLM has let it
        go) and return its LoRA id; None if it is gone already or in use again."""
        if not self.holds(live) or live.in_flight:
            return None
        del self.resident[live.lora_name]  # before any await: no second unload
        lora_int_id, live.lora_int_id = live.lora_int_id, 0
        self.on_leave(live)
        self.unloading += 1
        return lora_int_id

    async def _unload_taken(self, live: LiveAdapter, lora_int_id: int, event: str) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        try:
            await self._engine_done_with(live.lora_name)
            await self.models.unload_lora_adapter(
                UnloadLoRAAdapterRequest(lora_name=live.lora_name))
            await self.engine.remove_lora(lora_int_id)
        finally:
            self.unloading -= 1
            self.room.set()
        self.on_event(live.lora_name, event, None)
        logger.info("adapter %s %s (%d of %d resident)", live.lora_name, event,
                    len(self.resident), self.max_resident)

    def trim(self) -> None:
        """Unload idle resident adapters past ``max_resident``, least recently used first: a
        lowered bound holds at once for the idle ones, and for one in use when its last
        request ends."""
        for live in list(self.resident.values()):
            if len(self.resident) <= self.max_resident:
                return
            if live.in_flight == 0:
                self.unload_soon(live, "evicted")

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
