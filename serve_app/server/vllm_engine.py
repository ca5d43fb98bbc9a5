"""Engines behind vLLM's own front end: :class:`VllmFrontEnd` and :class:`VllmEngine`.

We reuse vLLM's API-server wiring (``init_app_state`` on the namespace of
:func:`~serve_app.server.engine.engine_config`), so chat templating, request validation,
sampling-parameter checks, streaming chunk format and error bodies are exactly those of
``vllm serve``; only the HTTP layer is ours (the router). What runs under the front end is
the subclass's: vLLM's engine-core processes here, a simulated core in
:class:`~serve_app.sim.engine.SimEngine`.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from serve_app.common.config import VariantArgs
from serve_app.common.wire import CALIBRATION_TOKENS, Usage
from serve_app.server.drills import VllmDrills
from serve_app.server.engine_protocol import Engine
from serve_app.server.serving import EngineAnswer, EngineError


class VllmFrontEnd(Engine):
    """An :class:`Engine` that is vLLM's ``AsyncLLM`` and vLLM's OpenAI serving objects bound
    to it (``chat``, ``completion``, ``models``); a subclass starts the ``AsyncLLM``
    (:meth:`_start_engine_client`). Before :meth:`start` returns, ``engine_client`` is None
    and :meth:`shutdown` does nothing."""

    def __init__(self, args: VariantArgs) -> None:
        self.args = args
        self.engine_client: Any = None  # vllm.v1.engine.async_llm.AsyncLLM
        self.chat: Any = None  # OpenAIServingChat
        self.completion: Any = None  # OpenAIServingCompletion
        self.models: Any = None  # OpenAIServingModels

    @abc.abstractmethod
    async def _start_engine_client(self, engine_args: Any, vllm_config: Any,
                                   stat_loggers: list) -> Any:
        """Start the ``AsyncLLM`` for ``vllm_config`` with ``stat_loggers`` (vLLM's
        ``StatLoggerFactory`` list) and return it.

        Raises:
            RuntimeError: the engine failed to start.
        """

    async def start(self) -> None:
        """Build vLLM's config from ``args`` (:func:`~serve_app.server.engine.engine_config`),
        start the ``AsyncLLM`` and vLLM's OpenAI serving state for it (~30 s on a 2-core CPU
        for vLLM's engine; seconds for the simulated one). Engine series go to Ray's metrics
        with a ``variant`` label (:class:`~serve_app.observability.engine_metrics.VariantStatLogger`).

        Raises:
            ValueError: invalid engine arguments. RuntimeError: the engine failed to start.
        """
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        from serve_app.observability.engine_metrics import VariantStatLogger
        from serve_app.server.engine import engine_config

        ns, engine_args, vllm_config = engine_config(self.args)
        if self.args.gpus_per_replica > 1:
            # The replica runs in the placement group Serve made from its bundles (one per
            # GPU, serve_app.common.deployment_options.replica_placement); vLLM's Ray executor
            # places a worker on each GPU bundle of it, as Ray Serve LLM's vLLM engine does.
            from ray.util import get_current_placement_group

            vllm_config.parallel_config.placement_group = get_current_placement_group()
        client = await self._start_engine_client(engine_args, vllm_config, [VariantStatLogger])
        try:
            state = State()
            await init_app_state(client, state, ns,
                                 supported_tasks=await client.get_supported_tasks())
        except BaseException:
            client.shutdown()
            raise
        lora = vllm_config.lora_config
        self.engine_client = client
        self.chat = state.openai_serving_chat
        self.completion = state.openai_serving_completion
        self.models = state.openai_serving_models
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_lora_rank = lora.max_lora_rank if lora else 0
        self.max_cpu_loras = (lora.max_cpu_loras or 0) if lora else 0
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.max_loras = lora.max_loras if lora else 0
        self.priority_scheduling = vllm_config.scheduler_config.policy == "priority"

    @property
    def errored(self) -> bool:
        return self.engine_client.errored

    async def run(self, endpoint: str, body: dict[str, Any]
                  ) -> EngineAnswer | EngineError | AsyncIterator[str]:
        """Serve one OpenAI body (``endpoint`` ``"chat"`` or ``"completion"``) with vLLM's own
        request classes and serving objects, so validation, templating and the SSE format are
        ``vllm serve``'s.

        Raises:
            pydantic.ValidationError: a body vLLM's protocol refuses; anything vLLM raises.
        """
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if endpoint == "chat":
            result = await self.chat.create_chat_completion(
                ChatCompletionRequest.model_validate(body), None)
        else:
            result = await self.completion.create_completion(
                CompletionRequest.model_validate(body), None)
        if isinstance(result, ErrorResponse):
            return EngineError(result.error.code, result.error.message, result.error.param)
        if hasattr(result, "model_dump_json"):
            u = result.usage
            return EngineAnswer(result.model_dump_json(), Usage(
                u.prompt_tokens, u.completion_tokens or 0) if u else None)
        return result  # the SSE lines of a stream

    async def full_batch_service_s(self, tokens: int = CALIBRATION_TOKENS) -> float:
        """Seconds one request of ``tokens`` generated tokens holds the engine while
        ``max_num_seqs`` run at once: one warm-up request, then one timed full batch of
        short prompts (``ignore_eos``). The router's admission assumes it for a full
        variant until it has learned the real figure (:mod:`serve_app.admission.variant_queue`).
        ~4 s on a 2-core CPU host, well under a second on a GPU."""
        import uuid

        from vllm import SamplingParams

        async def one(n: int) -> None:
            params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
            async for _ in self.engine_client.generate("Count to ten: one, two,", params,
                                                       f"mesh-calibrate-{uuid.uuid4().hex}"):
                pass
        await one(2)
        t0 = time.monotonic()
        await asyncio.gather(*(one(tokens) for _ in range(self.max_num_seqs)))
        return time.monotonic() - t0

    async def check_health(self) -> None:
        """Raises if the engine is dead (vLLM's ``EngineDeadError``)."""
        await self.engine_client.check_health()

    def num_unfinished(self) -> int:
        return self.engine_client.get_num_unfinished_requests()

    def shutdown(self) -> None:
        if self.engine_client is not None:
            self.engine_client.shutdown()


class VllmEngine(VllmFrontEnd):
    """``engine: vllm``: vLLM's ``AsyncLLM`` on its own engine-core processes (the model's
    weights on the replica's GPUs, or its CPU). Drills: :class:`~serve_app.server.drills.VllmDrills`."""

    def __init__(self, args: VariantArgs) -> None:
        super().__init__(args)
        self.drills = VllmDrills()

    async def _start_engine_client(self, engine_args: Any, vllm_config: Any,
                                   stat_loggers: list) -> Any:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
            stat_loggers=stat_loggers,  # vllm:* series on Ray's metrics, per variant
        )

    def engine_state(self) -> dict[str, Any]:
        """``{"engine": "vllm", "unfinished": n}``: the requests vLLM still holds."""
        return {"engine": "vllm", "unfinished": self.num_unfinished()}
