"""The adapters one replica may serve (*declared*), made equal to its ``user_config``.

*Declared* is what the variant may serve: the replica's ``user_config.adapters`` lists
``{name, version}``, specs come from the adapter registry (:mod:`serve_app.common.adapters`),
and :meth:`AdapterReconciler.reconcile` verifies every one without loading it (base model,
rank; for a local folder also SHA-256, target modules, no pickle). Hundreds may be declared.

- At reconcile the declared adapters are preloaded in config order while there is room
  without evicting anything, so a variant with a few adapters serves them all warm.
- a new version of a served name takes new requests at once; requests in flight finish on the
  old one, which is unloaded when its last request ends;
- several versions of one name may be declared (an adapter version canary): the router picks
  one per caller (``route:name@vN``); a request naming no version gets the first listed;
- a removed adapter stops taking requests (404) and is unloaded once its requests end; a
  retired *version* still serves requests that name it (``name@vN``) for
  :data:`RETIRED_GRACE_S`, since the router may send one on a view a moment old (a version
  promotion, v1/v2 to v2, must give nobody a 404); unversioned requests get the new default
  at once;
- a broken adapter is refused with its reason (see :attr:`AdapterReconciler.refused`) and
  changes nothing else: the version that served before keeps serving.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

from serve_app.common.adapters import (AdapterError, AdapterSpec, adapter_key, adapter_name,
                                       load_manifest, verify_adapter)
from serve_app.common.logs import get_logger
from serve_app.server.lora_residency import LiveAdapter, Residency
from serve_app.server.lora_slot_gate import SlotGate

logger = get_logger(__name__)

#: Seconds a retired adapter version still serves requests that name it: longer than the
#: router's view of the replica's adapters takes to follow a deploy (its poll, ~1 s, and the
#: router's own reconfigure).
RETIRED_GRACE_S = 10.0


class AdapterReconciler:
    """The declared adapter versions of one replica, and which version takes a request.

    Args:
        residency: the resident adapters (a retired one is unloaded once idle).
        slots: the slot gate (reconcile's warm-up loads through it).
        base_model: the variant's ``args.model`` (adapters must be trained for it:
            :func:`~serve_app.common.adapters.base_model_problem`).
        base_revision: the variant's ``args.revision`` (a hub model's commit).
        max_lora_rank: the engine's ``max_lora_rank``.
        max_cpu_loras: the engine's ``max_cpu_loras``: the default and the ceiling of
            ``max_resident``.
        clock: monotonic s, the clock of the event loop's timers.
        on_event: ``(adapter_key, "refused", None)`` for an adapter refused at reconcile.
    """

    def __init__(self, residency: Residency, slots: SlotGate, *, base_model: str,
                 max_lora_rank: int, max_cpu_loras: int, base_revision: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[str, str, float | None], None] = lambda *_: None) -> None:
        self.residency = residency
        self.slots = slots
        self.base_model = base_model
        self.base_revision = base_revision
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.clock = clock
        self.on_event = on_event
        self.active: dict[str, LiveAdapter] = {}  # declared "name@vN" taking new requests
        self.default: dict[str, str] = {}  # adapter name -> "name@vN" for unversioned requests
        self.refused: dict[str, str] = {}  # "name@vN" -> reason
        self._retired_at: dict[str, tuple[LiveAdapter, float]] = {}  # key -> (it, monotonic)
        self._lock = asyncio.Lock()

    async def reconcile(self, refs: list[tuple[str, int]], manifest: Path | None,
                        max_resident: int | None = None) -> None:
        """Make the declared set equal ``refs`` (``(name, version)`` pairs, in config order),
        with at most ``max_resident`` adapters resident (None: the engine's ``max_cpu_loras``).

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
            self.residency.max_resident = limit
            self.residency.room.set()  # a higher limit may let waiting loads go
            wanted = [adapter_key(name, version) for name, version in refs]
            refused_names = set()
            for key in wanted:
                if key not in self.active and not await self._declare(key, specs, manifest):
                    refused_names.add(adapter_name(key))
            for key in [k for k in self.active if k not in wanted]:
                self._retire(key, wanted, refused_names)
            self.residency.trim()  # a lowered max_resident
            order = [k for k in wanted if k in self.active] + list(self.active)
            self.default = {}
            for key in order:
                self.default.setdefault(adapter_name(key), key)
            await self._warm(order)

    async def _declare(self, key: str, specs: dict[str, AdapterSpec],
                       manifest: Path | None) -> bool:
        """Make ``key`` take new requests: the version still resident, loading or in its
        grace if there is one (one object per key), else a new one once verified. False:
        refused."""
        load = self.slots.loads.get(key)
        held = self.residency.resident.get(key) or (load.live if load else None)
        if held is None and self.in_grace(key):
            held = self._retired_at[key][0]
        self._retired_at.pop(key, None)
        if held is not None:  # draining or loading: take it back
            self.active[key] = held
            logger.info("adapter %s serves new requests again", key)
            return True
        try:
            spec = specs.get(key)
            if spec is None:
                raise AdapterError(f"adapter {key} is not in the registry "
                                   f"{manifest or 'adapters/manifest.yaml'}; add it there")
            path = await asyncio.to_thread(verify_adapter, spec, base_model=self.base_model,
                                           max_lora_rank=self.max_lora_rank,
                                           base_revision=self.base_revision)
        except AdapterError as e:
            self._refuse(key, str(e))
            return False
        self.active[key] = LiveAdapter(spec, path)
        self.refused.pop(key, None)
        logger.info("adapter %s declared: it now takes new requests", key)
        return True

    def _retire(self, key: str, wanted: list[str], refused_names: set[str]) -> None:
        """``key`` is no longer in the config: it stops taking new requests (unless it is
        the last version of a name whose replacement was refused)."""
        if adapter_name(key) in refused_names and not any(
                adapter_name(k) == adapter_name(key) and k in self.active for k in wanted):
            logger.warning("adapter %s keeps serving: its replacement was refused", key)
            return
        live = self.active.pop(key)
        if any(adapter_name(k) == adapter_name(key) for k in self.active):
            # another version of the name serves now: a promotion
            self._retired_at[key] = (live, self.clock())
            asyncio.get_running_loop().call_later(RETIRED_GRACE_S + 0.1,
                                                  self.unload_if_retired, live)
        self.unload_if_retired(live)
        logger.info("adapter %s retired: new requests no longer use it%s", key,
                    f" (requests that name it still do for {RETIRED_GRACE_S:.0f} s)"
                    if key in self._retired_at else "")

    async def _warm(self, order: list[str]) -> None:
        """Load the declared adapters in ``order`` while they fit without evicting anything;
        the rest loads on first use."""
        resident, loads = self.residency.resident, self.slots.loads
        for key in order:
            if len(resident) + len(loads) >= self.residency.max_resident:
                break  # (loads waiting for room count too: warming never waits or evicts)
            live = self.active.get(key)
            if live is not None and key not in resident and key not in loads:
                try:
                    await self.slots.make_resident(live)
                except AdapterError:
                    continue  # refused by vLLM; Residency.load recorded why

    def _refuse(self, key: str, reason: str) -> None:
        self.refused[key] = reason
        self.on_event(key, "refused", None)
        logger.error("adapter %s refused: %s", key, reason)

    def unload_if_retired(self, live: LiveAdapter) -> None:
        """Unload ``live`` if it is resident, no longer declared and idle (a retired adapter
        goes when its last request ends, or at once if it has none)."""
        if (live.in_flight == 0 and self.active.get(live.lora_name) is not live
                and self.residency.holds(live) and not self.in_grace(live.lora_name)):
            self.residency.unload_soon(live, "unloaded")

    def in_grace(self, key: str) -> bool:
        """``key`` was retired less than :data:`RETIRED_GRACE_S` ago."""
        live, at = self._retired_at.get(key, (None, float("-inf")))
        if self.clock() - at < RETIRED_GRACE_S:
            return True
        self._retired_at.pop(key, None)
        return False

    def version_for(self, adapter: str) -> LiveAdapter | None:
        """The version that takes a request for ``adapter`` (``name@vN``, or ``name`` for its
        default version); a retired version within its grace when named; None: not served."""
        live = self.active.get(self.default.get(adapter, adapter))
        if live is None and self.in_grace(adapter):
            live = self._retired_at[adapter][0]  # the router's view is a moment old
        return live

    def serving(self) -> list[str]:
        """Versions that take requests: the declared ones, and retired ones within their
        grace (requests that name them)."""
        return [*self.active, *(k for k in list(self._retired_at) if self.in_grace(k))]
