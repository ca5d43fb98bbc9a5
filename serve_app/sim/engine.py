"""``engine: sim``: :class:`SimEngine`, vLLM's front end on the simulated engine core, and its
drills (:class:`SimDrills`).

The replica gets it by injection (:func:`serve_app.server.engine.engine_cls_for`), never by a
branch in the production engine. Its drills, all set in ``args.sim``
(:class:`~serve_app.common.config.SimArgs`) except ``kill_engine``:

- ``kill_engine`` (by name, ``LLMReplica.drill``): the core dies
  (:meth:`~serve_app.sim.core.SimEngineCore.die`);
- ``reconfigure_s``: every ``reconfigure()`` of the replica first waits that long
  (:meth:`SimDrills.before_reconfigure`; Serve shows the replica ``UPDATING``);
- ``start_s`` / ``fail_start``: the engine starts that slowly, or fails to start with that
  reason (:func:`~serve_app.sim.core.start_sim_async_llm`, at :meth:`SimEngine.start`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from serve_app.common.config import SimArgs, VariantArgs
from serve_app.server.vllm_engine import VllmFrontEnd


class SimEngine(VllmFrontEnd):
    """vLLM's ``AsyncLLM`` and OpenAI serving objects on a
    :class:`~serve_app.sim.core.SimEngineCore` (no weights; seconds to start). ``args.sim``
    (None: the defaults of :class:`SimArgs`) sets its profile and drills."""

    def __init__(self, args: VariantArgs) -> None:
        super().__init__(args)
        self.drills = SimDrills(self, reconfigure_s=(args.sim or SimArgs()).reconfigure_s)

    async def _start_engine_client(self, engine_args: Any, vllm_config: Any,
                                   stat_loggers: list) -> Any:
        """:func:`~serve_app.sim.core.start_sim_async_llm`.

        Raises:
            RuntimeError: ``args.sim.fail_start`` is set.
        """
        from serve_app.sim.core import start_sim_async_llm

        return await start_sim_async_llm(self.args, vllm_config, stat_loggers=stat_loggers)

    def engine_state(self) -> dict[str, Any]:
        """``{"engine": "sim", ...}`` with the core's
        :meth:`~serve_app.sim.core.SimEngineCore.status`: requests ``waiting`` and
        ``running``, resident ``loras``, ``running_loras`` and ``lora_removed_in_use``."""
        return {"engine": "sim", **self.engine_client.engine_core.status()}


class SimDrills:
    """The simulated engine's drills (:class:`~serve_app.server.drills.EngineDrills`).

    Args:
        engine: the engine they act on (its core exists once it has started).
        reconfigure_s: seconds every ``reconfigure()`` of the replica waits first (0: none).
    """

    names = frozenset({"kill_engine"})

    def __init__(self, engine: SimEngine, reconfigure_s: float = 0.0) -> None:
        self.engine = engine
        self.reconfigure_s = reconfigure_s

    def kill_engine(self) -> None:
        """The core dies as vLLM's engine core does: requests in flight fail with
        ``EngineDeadError``, ``errored`` turns true and ``check_health`` raises."""
        self.engine.engine_client.engine_core.die()

    async def before_reconfigure(self) -> None:
        """Wait ``reconfigure_s`` seconds (none when it is 0)."""
        if self.reconfigure_s:
            await asyncio.sleep(self.reconfigure_s)
