"""The engine seam: what a replica needs of an engine, and the drills-only interface beside it.

``LLMReplica`` (:mod:`serve_app.replica`) runs on an :class:`Engine` whose class is chosen
once, at its start, from ``args.engine`` (:func:`serve_app.server.engine.engine_cls_for`), as
Ray Serve LLM's ``LLMServer(engine_cls=...)`` takes an ``LLMEngine`` and vLLM's serving objects
take an ``EngineClient``. Two implementations:

- :class:`~serve_app.server.vllm_engine.VllmEngine` (``engine: vllm``): vLLM's ``AsyncLLM`` on
  its own engine-core processes;
- :class:`~serve_app.sim.engine.SimEngine` (``engine: sim``): the same ``AsyncLLM`` front end
  on a simulated engine core (:mod:`serve_app.sim`).

Drills (kill the engine, a slow reconfigure, a slow or failed start) are not methods of an
engine: each has a separate :class:`~serve_app.server.drills.EngineDrills` object (or None),
which ``LLMReplica`` reaches only through :func:`serve_app.server.drills.run_drill` and the
one reconfigure hook.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from serve_app.common.wire import CALIBRATION_TOKENS

if TYPE_CHECKING:
    from serve_app.common.config import VariantArgs
    from serve_app.server.drills import EngineDrills
    from serve_app.server.serving import EngineAnswer, EngineError


class Engine(abc.ABC):
    """What ``LLMReplica`` needs of an engine (the seam; vLLM's ``EngineClient`` is the
    engine-side counterpart). Built with ``cls(args)`` (:class:`VariantArgs`), then
    ``await start()``; the attributes below are set once :meth:`start` returns.

    Attributes:
        max_model_len: tokens of prompt and answer one request may hold.
        max_num_seqs: requests the engine runs at once.
        max_loras: distinct LoRA adapters one batch may mix (0: LoRA off).
        max_lora_rank: the largest adapter rank the engine takes (0: LoRA off).
        max_cpu_loras: adapters the engine keeps loaded (0: LoRA off).
        priority_scheduling: ``scheduling_policy: priority``; requests carry a priority.
        models: vLLM's ``OpenAIServingModels``: LoRA adapters are added and removed through
            it (``load_lora_adapter`` / ``unload_lora_adapter``, by
            :class:`~serve_app.server.lora.AdapterSet`).
        engine_client: vLLM's ``EngineClient`` (an ``AsyncLLM``): ``remove_lora`` frees an
            adapter from its cache; its ``output_processor`` says which requests use one.
        drills: the engine's drills (:class:`~serve_app.server.drills.EngineDrills`), or
            None: it has none.
    """

    max_model_len: int
    max_num_seqs: int
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    priority_scheduling: bool
    models: Any
    engine_client: Any
    drills: EngineDrills | None = None

    @abc.abstractmethod
    def __init__(self, args: VariantArgs) -> None:
        """Keep ``args``; start nothing (:meth:`start` does)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the engine and its OpenAI serving state.

        Raises:
            ValueError: invalid engine arguments (the message names the field).
            RuntimeError: the engine failed to start.
        """

    @property
    @abc.abstractmethod
    def errored(self) -> bool:
        """The engine has died (vLLM ``EngineClient.errored``)."""

    @abc.abstractmethod
    async def run(self, endpoint: str, body: dict[str, Any]
                  ) -> EngineAnswer | EngineError | AsyncIterator[str]:
        """Serve one OpenAI body (``endpoint`` ``"chat"`` or ``"completion"``): a whole
        answer, the engine's error answer, or a stream's SSE lines.

        Raises:
            Exception: anything the engine raises;
                :func:`~serve_app.common.failures.replica_verdict` classifies it.
        """

    @abc.abstractmethod
    async def full_batch_service_s(self, tokens: int = CALIBRATION_TOKENS) -> float:
        """Seconds one request of ``tokens`` generated tokens holds the engine while
        ``max_num_seqs`` run at once (the start-up calibration the router's admission
        assumes until it has measured the variant)."""

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raises if the engine is dead."""

    @abc.abstractmethod
    def num_unfinished(self) -> int:
        """Requests the engine still holds."""

    @abc.abstractmethod
    def engine_state(self) -> dict[str, Any]:
        """The engine's own view, for tests and debugging: ``{"engine": "vllm" | "sim",
        ...}`` and what that engine can tell (see each implementation)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and its processes."""
