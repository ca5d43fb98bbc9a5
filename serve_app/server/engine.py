"""Build a vLLM engine and vLLM's own OpenAI serving objects from a variant's ``args``.

We reuse vLLM's API-server wiring (``make_arg_parser`` defaults + ``init_app_state``), so chat
templating, request validation, sampling-parameter checks, streaming chunk format and error
bodies are exactly those of ``vllm serve``; only the HTTP layer is ours (the router).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from serve_app.common.config import VariantArgs
from serve_app.common.fetch import model_dir_here
from serve_app.common.wire import CALIBRATION_TOKENS, Usage
from serve_app.server.serving import EngineAnswer, EngineError



@dataclass
class EngineHandle:
    """A running vLLM engine and vLLM's OpenAI serving objects bound to it: the
    :class:`~serve_app.server.serving.ServingEngine` that ``LLMReplica`` serves with."""

    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    chat: Any  # OpenAIServingChat
    completion: Any  # OpenAIServingCompletion
    models: Any  # OpenAIServingModels
    max_model_len: int
    max_lora_rank: int  # 0 when LoRA is off
    max_cpu_loras: int  # LoRAs vLLM keeps loaded (0 when LoRA is off)
    max_num_seqs: int  # requests the engine runs at once
    max_loras: int  # distinct LoRA adapters in one batch (0 when LoRA is off)
    priority_scheduling: bool  # scheduling_policy "priority": requests carry a priority

    @property
    def errored(self) -> bool:
        return self.engine.errored

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
            async for _ in self.engine.generate("Count to ten: one, two,", params,
                                                f"mesh-calibrate-{uuid.uuid4().hex}"):
                pass
        await one(2)
        t0 = time.monotonic()
        await asyncio.gather(*(one(tokens) for _ in range(self.max_num_seqs)))
        return time.monotonic() - t0

    async def check_health(self) -> None:
        """Raises if the engine is dead."""
        await self.engine.check_health()

    def num_unfinished(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def kill(self) -> None:
        """Drills: kill the engine as a crash would. vLLM's engine-core process gets
        SIGKILL; a simulated core dies (:meth:`serve_app.sim.core.SimEngineCore.die`).
        Requests in flight then fail as on a dead engine, and the health check fails."""
        core = self.engine.engine_core
        if hasattr(core, "die"):
            core.die()
            return
        import psutil

        for proc in psutil.Process().children(recursive=True):
            if proc.name().startswith("VLLM::EngineCor"):
                proc.kill()

    def engine_state(self) -> dict[str, Any]:
        """The engine's own view (tests): a simulated core's requests and adapters
        (:meth:`~serve_app.sim.core.SimEngineCore.status`); for vLLM, its unfinished
        requests."""
        core = self.engine.engine_core
        if hasattr(core, "status"):
            return {"engine": "sim", **core.status()}
        return {"engine": "vllm", "unfinished": self.num_unfinished()}

    def shutdown(self) -> None:
        self.engine.shutdown()


def build_cli_namespace(args: VariantArgs):
    """vLLM's API-server argument namespace with our values set on top of its defaults.

    Mappings (``structured_outputs_config: {backend: guidance}``, ``compilation_config``,
    ...) go through vLLM's own argument parser, as JSON, so they become vLLM's config
    objects; plain values are set as they are.

    Raises:
        ValueError: an ``engine_args`` key that vLLM does not know (the message lists it), or
            a mapping vLLM's parser refuses.
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    known = parser.parse_args([])
    unknown = sorted(k for k in args.engine_args if not hasattr(known, k))
    if unknown:
        raise ValueError(f"unknown vLLM engine_args: {', '.join(unknown)} "
                         "(use AsyncEngineArgs field names, e.g. max_model_len)")
    mappings = {k: v for k, v in args.engine_args.items() if isinstance(v, dict)}
    try:
        ns = parser.parse_args([a for k, v in mappings.items()
                                for a in (f"--{k.replace('_', '-')}", json.dumps(v))])
    except SystemExit:  # argparse exits on a bad value; its message went to stderr
        raise ValueError(f"vLLM refused engine_args {', '.join(mappings)}: "
                         f"{json.dumps(mappings)}") from None
    ns.model = model_dir_here(args.model, args.revision)
    ns.served_model_name = [args.served_model_name]
    for key, value in args.engine_args.items():
        if key not in mappings:
            setattr(ns, key, value)
    if args.gpus_per_replica > 1:  # workers in the replica's placement group, as Ray Serve LLM
        ns.distributed_executor_backend = "ray"
    validate_parsed_serve_args(ns)
    return ns


def engine_config(args: VariantArgs):
    """vLLM's argument namespace, ``AsyncEngineArgs`` and ``VllmConfig`` for ``args``, with
    every check vLLM makes before it starts an engine (model config, ``max_model_len``
    against the model, dtype, scheduler limits, LoRA settings). Takes ~10 s the first time
    in a process (it imports vLLM and reads the model's config), and starts nothing.

    Raises:
        ValueError: an invalid engine argument; the message is vLLM's and names the field
            (pydantic's ``ValidationError`` is a ``ValueError``).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    ns = build_cli_namespace(args)
    engine_args = AsyncEngineArgs.from_cli_args(ns)
    return ns, engine_args, engine_args.create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)


async def start_engine(args: VariantArgs) -> EngineHandle:
    """Start an ``AsyncLLM`` and vLLM's OpenAI serving state for it (~30 s on a 2-core CPU);
    with ``args.engine == "sim"``, vLLM's ``AsyncLLM`` on a simulated engine core
    (:mod:`serve_app.sim.core`: no weights, seconds to start).

    Raises:
        ValueError: invalid engine arguments. RuntimeError: the engine failed to start.
    """
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from serve_app.observability.engine_metrics import VariantStatLogger

    ns, engine_args, vllm_config = engine_config(args)
    if args.gpus_per_replica > 1:
        # The replica runs in the placement group Serve made from its bundles (one per GPU,
        # serve_app.common.deployment_options.replica_placement); vLLM's Ray executor places
        # a worker on each GPU bundle of it, as Ray Serve LLM's vLLM engine does.
        from ray.util import get_current_placement_group

        vllm_config.parallel_config.placement_group = get_current_placement_group()
    if args.engine == "sim":  # vLLM's front end on a simulated engine core
        from serve_app.sim.core import start_sim_async_llm

        engine = await start_sim_async_llm(args, vllm_config, stat_loggers=[VariantStatLogger])
    else:
        engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
            stat_loggers=[VariantStatLogger],  # vllm:* series on Ray's metrics, per variant
        )
    try:
        state = State()
        await init_app_state(engine, state, ns, supported_tasks=await engine.get_supported_tasks())
    except BaseException:
        engine.shutdown()
        raise
    return EngineHandle(engine=engine, chat=state.openai_serving_chat,
                        completion=state.openai_serving_completion,
                        models=state.openai_serving_models,
                        max_model_len=vllm_config.model_config.max_model_len,
                        max_lora_rank=(vllm_config.lora_config.max_lora_rank
                                       if vllm_config.lora_config else 0),
                        max_cpu_loras=(vllm_config.lora_config.max_cpu_loras or 0
                                       if vllm_config.lora_config else 0),
                        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                        max_loras=(vllm_config.lora_config.max_loras
                                   if vllm_config.lora_config else 0),
                        priority_scheduling=vllm_config.scheduler_config.policy == "priority")
