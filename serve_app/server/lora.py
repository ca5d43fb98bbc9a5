"""Adapter lifecycle inside one ``LLMReplica``: reconcile the declared adapter set in place.

The replica's ``user_config.adapters`` lists ``{name, version}``; specs come from the adapter
registry (:mod:`serve_app.common.adapters`). :meth:`AdapterSet.reconcile`:

- a new adapter is verified (SHA-256, base model, rank, target modules, no pickle) and loaded
  into vLLM under the versioned LoRA name ``name@vN`` (so prefix-cache blocks of one version
  are never reused for another);
- a new version of a served name is loaded under its own name; new requests use it at once;
  requests in flight finish on the old one, which is unloaded when its last request ends;
- several versions of one name may be listed (an adapter version canary): all are served,
  the router picks one per caller (``route:name@vN``); a request naming no version gets the
  first listed;
- a removed adapter stops taking requests (404) and is unloaded once its requests end;
- a broken adapter is refused with its reason (see :attr:`AdapterSet.refused`) and changes
  nothing else: the version that served before keeps serving.

vLLM limits: ``max_loras`` adapters can be in one batch; ``max_cpu_loras`` (default
``max_loras``) stay loaded in memory. Every declared adapter is loaded, plus, during an
upgrade, the retiring version; beyond ``max_cpu_loras`` vLLM evicts the least recently used
one and reloads it from disk when asked, so keep ``max_cpu_loras`` >= adapters + 1.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.common.logs import get_logger
from serve_app.common.adapters import (AdapterError, AdapterSpec, adapter_key, adapter_name,
                                load_manifest, verify_adapter)
from serve_app.common.errors import MeshError

logger = get_logger(__name__)


@dataclass
class LiveAdapter:
    """An adapter version loaded in vLLM, with the requests currently using it."""

    spec: AdapterSpec
    lora_name: str  # name registered in vLLM's OpenAIServingModels: "name@vN"
    lora_int_id: int
    in_flight: int = 0


class AdapterSet:
    """The adapters one replica serves.

    Args:
        models: vLLM's ``OpenAIServingModels`` of the engine (loads/unloads LoRAs).
        engine: the ``AsyncLLM`` (frees a LoRA from its cache on unload).
        base_model: the variant's model name (adapters must be trained for it).
        max_lora_rank: the engine's ``max_lora_rank``.
        on_event: callback ``(adapter_key, event)`` for metrics/logs; event in
            ``loaded | unloaded | refused``.
    """

    def __init__(self, models: Any, engine: Any, *, base_model: str, max_lora_rank: int,
                 on_event=lambda key, event: None) -> None:
        self.models = models
        self.engine = engine
        self.base_model = base_model
        self.max_lora_rank = max_lora_rank
        self.on_event = on_event
        self.active: dict[str, LiveAdapter] = {}  # "name@vN" -> version taking new requests
        self.default: dict[str, str] = {}  # adapter name -> "name@vN" for unversioned requests
        self.retiring: dict[str, LiveAdapter] = {}  # "name@vN" -> version draining
        self.refused: dict[str, str] = {}  # "name@vN" -> reason
        self.load_seconds: dict[str, float] = {}  # "name@vN" -> verify + load time, s
        self._lock = asyncio.Lock()

    # -- reconcile ---------------------------------------------------------------------------

    async def reconcile(self, refs: list[tuple[str, int]], manifest: Path | None) -> None:
        """Make the served set equal ``refs`` (``(name, version)`` pairs, in config order).

        Several versions of one name may be served at once (an adapter version canary; the
        router picks the version per caller). Requests that name no version get the first
        listed version of the name (:meth:`acquire`).

        Never raises for a bad adapter: it is refused (reason in :attr:`refused`), the rest of
        the set is applied, and the versions of that name that served before keep serving.

        Raises:
            AdapterError: the manifest itself is unreadable (nothing is changed).
        """
        specs = await asyncio.to_thread(load_manifest, manifest) if refs else {}
        async with self._lock:
            wanted = [adapter_key(name, version) for name, version in refs]
            refused_names = set()
            for key in wanted:
                if key in self.active:
                    continue
                if key in self.retiring:  # still draining: take it back instead of reloading
                    self.active[key] = self.retiring.pop(key)
                    logger.info("adapter %s serves new requests again", key)
                    continue
                try:
                    spec = specs.get(key)
                    if spec is None:
                        raise AdapterError(f"adapter {key} is not in the registry "
                                           f"{manifest or 'adapters/manifest.yaml'}; add it there")
                    self.active[key] = await self._load(spec)
                except AdapterError as e:
                    refused_names.add(adapter_name(key))
                    self.refused[key] = str(e)
                    self.on_event(key, "refused")
                    logger.error("adapter %s refused: %s", key, e)
                    continue
                self.refused.pop(key, None)
                logger.info("adapter %s now serves new requests", key)
            for key in [k for k in self.active if k not in wanted]:
                if adapter_name(key) in refused_names and not any(
                        adapter_name(k) == adapter_name(key) and k in self.active for k in wanted):
                    logger.warning("adapter %s keeps serving: its replacement was refused", key)
                    continue
                self._retire(self.active.pop(key))
                logger.info("adapter %s retired: new requests no longer use it", key)
            order = [k for k in wanted if k in self.active] + list(self.active)
            self.default = {}
            for key in order:
                self.default.setdefault(adapter_name(key), key)

    async def _load(self, spec: AdapterSpec) -> LiveAdapter:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        t0 = asyncio.get_running_loop().time()
        path = await asyncio.to_thread(verify_adapter, spec, base_model=self.base_model,
                                       max_lora_rank=self.max_lora_rank)
        result = await self.models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=spec.key, lora_path=str(path)))
        if isinstance(result, ErrorResponse):
            raise AdapterError(f"vLLM could not load adapter {spec.key}: {result.error.message}")
        lora = self.models.lora_requests[spec.key]
        self.load_seconds[spec.key] = asyncio.get_running_loop().time() - t0
        self.on_event(spec.key, "loaded")
        return LiveAdapter(spec=spec, lora_name=spec.key, lora_int_id=lora.lora_int_id)

    def _retire(self, live: LiveAdapter) -> None:
        self.retiring[live.lora_name] = live
        if live.in_flight == 0:
            asyncio.get_running_loop().create_task(self._unload(live))

    async def _unload(self, live: LiveAdapter) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        if self.retiring.pop(live.lora_name, None) is None:
            return
        await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=live.lora_name))
        await self.engine.remove_lora(live.lora_int_id)
        self.on_event(live.lora_name, "unloaded")
        logger.info("adapter %s unloaded (its last request ended)", live.lora_name)

    # -- requests ----------------------------------------------------------------------------

    def acquire(self, adapter: str) -> LiveAdapter:
        """The version that takes this request; count the request on it.

        Args:
            adapter: ``name@vN`` for one version, or ``name`` for its default version (the
                first one listed in the config).

        Raises:
            MeshError: 404 if this replica does not serve it.
        """
        live = self.active.get(self.default.get(adapter, adapter))
        if live is None:
            raise MeshError(404, f"adapter {adapter!r} is not served by this variant",
                            param="model", code="adapter_not_found")
        live.in_flight += 1
        return live

    def release(self, live: LiveAdapter) -> None:
        """A request on ``live`` ended; unload it if it is retiring and now idle."""
        live.in_flight -= 1
        if live.in_flight == 0 and live.lora_name in self.retiring:
            asyncio.get_running_loop().create_task(self._unload(live))

    def status(self) -> dict[str, Any]:
        """Served, draining and refused adapters, for the admin endpoint."""
        return {
            "active": {k: {"in_flight": a.in_flight, "default": k in self.default.values()}
                       for k, a in self.active.items()},
            "retiring": {n: {"in_flight": a.in_flight} for n, a in self.retiring.items()},
            "refused": dict(self.refused),
            "load_seconds": {k: round(v, 3) for k, v in self.load_seconds.items()},
        }
