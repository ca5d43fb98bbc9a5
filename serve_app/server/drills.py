"""Drills: the interface apart from the engine, and :func:`run_drill`, the one way in.

An engine's drills are a separate object (``Engine.drills``; None: it has none), so the
production engine classes carry no drill methods and the replica carries one generic entry
(``LLMReplica.drill(name, **kw)``). The drills there are:

- ``kill_engine`` (both engines): the engine dies as in a crash (vLLM's engine-core processes
  get SIGKILL: :class:`VllmDrills`; the simulated core dies:
  :class:`~serve_app.sim.engine.SimDrills`). The real-engine test tier (``--all``) runs it on
  vLLM, so vLLM keeps it.
- a slow reconfigure (simulated engine only, ``args.sim.reconfigure_s``):
  :meth:`EngineDrills.before_reconfigure`, the one hook the replica calls without a name.
- a slow or failed start (simulated engine only, ``args.sim.start_s`` / ``fail_start``): at
  :meth:`~serve_app.sim.engine.SimEngine.start`, no hook.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol


class EngineDrills(Protocol):
    """An engine's drills.

    Attributes:
        names: the drills :func:`run_drill` may run by name, each a method of this object
            (sync or async).
    """

    names: frozenset[str]

    async def before_reconfigure(self) -> None:
        """Wait what the drill says every ``reconfigure()`` of the replica takes before it
        applies the new ``user_config`` (s); return at once when no such drill is set."""


async def run_drill(engine: Any, name: str, **kw: Any) -> Any:
    """Run the drill ``name`` of ``engine``'s drills with ``kw``; returns what it returns.
    ``engine``: an :class:`~serve_app.server.engine_protocol.Engine` (not imported here: that
    module imports this one's :class:`EngineDrills`).

    Raises:
        ValueError: the engine has no drills, or none called ``name`` (the message lists
            those it has). TypeError: ``kw`` the drill does not take.
    """
    drills = engine.drills
    if drills is None:
        raise ValueError(f"drill {name!r}: this replica's engine ({type(engine).__name__}) "
                         "has no drills; drills run on engines that define Engine.drills")
    if name not in drills.names:
        raise ValueError(f"unknown drill {name!r} for {type(engine).__name__}: use one of "
                         f"{', '.join(sorted(drills.names))}")
    result = getattr(drills, name)(**kw)
    return await result if inspect.isawaitable(result) else result


class VllmDrills:
    """vLLM's drills: ``kill_engine`` only."""

    names = frozenset({"kill_engine"})

    def kill_engine(self) -> None:
        """SIGKILL this process's vLLM engine-core processes (``VLLM::EngineCore``), as a
        crash would: requests in flight fail with vLLM's ``EngineDeadError``, the health check
        fails, and Serve replaces the replica."""
        import psutil

        for proc in psutil.Process().children(recursive=True):
            if proc.name().startswith("VLLM::EngineCor"):
                proc.kill()

    async def before_reconfigure(self) -> None:
        """No drill slows vLLM's reconfigure: returns at once."""
