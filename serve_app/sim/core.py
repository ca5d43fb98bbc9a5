"""The simulated engine core, and the ``AsyncLLM`` that runs on it.

vLLM's ``AsyncLLM`` is a front end (tokenizing, chat templates, request validation,
detokenizing, stop strings, ``n``, metrics) talking to an *engine core* in another process
(scheduler and model) through an ``EngineCoreClient``. :class:`SimEngineCore` takes that
client's place in-process: it schedules with :class:`~serve_app.sim.scheduler.SimScheduler`,
waits each step's cost-model seconds, and answers with the ``EngineCoreOutputs`` the real core
would send. Everything above it is vLLM's own code, unchanged: the OpenAI serving layer, the
output processor and vLLM's stat loggers (so the ``vllm:*`` metrics are vLLM's, under their
own names). No model weights are loaded; the model's config and tokenizer are read.

It can be told to die (:meth:`SimEngineCore.die`: every request in flight fails as on a dead
engine, and ``check_health`` raises), and :func:`start_sim_async_llm` can be told to start
slowly or to fail (``args.sim``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.lora.request import LoRARequest
from vllm.v1.engine import (EngineCoreEvent, EngineCoreEventType, EngineCoreOutput,
                            EngineCoreOutputs, EngineCoreRequest, FinishReason)
from vllm.v1.engine import async_llm as async_llm_module
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.stats import PrefillStats, PrefixCacheStats, SchedulerStats
from vllm.v1.outputs import LogprobsLists

from serve_app.common.adapters import MODEL_STAMP, AdapterError, load_manifest, merged_adapter
from serve_app.common.logs import get_logger
from serve_app.common.paths import model_identity, resolve_model_path
from serve_app.sim.answers import AnswerBook
from serve_app.common.sim_profile import SimProfile
from serve_app.sim.scheduler import (LENGTH, SimRequest, SimScheduler, Step, Token,
                                     evict_idle_lru)

logger = get_logger(__name__)

_FINISH = {"stop": FinishReason.STOP, LENGTH: FinishReason.LENGTH}


def merged_label(model: str) -> str | None:
    """Who answers a merged model's own weights on the simulated engine
    (:mod:`serve_app.sim.answers`); None for a model with no adapter merged in.

    The adapter version its stamp names (``name@vN``, as the LoRA path labels that version)
    only when the merge used that version's registered weights: the stamp's
    ``adapter_sha256`` is the registry's ``sha256`` for it. A merge of other weights (another
    version's, a retrained file) answers as ``name@vN#<their sha256>``: otherwise than the
    LoRA path, as real weights would, so a check that the merged variant answers as the LoRA
    path does can fail on this engine too."""
    key = merged_adapter(model)
    if key is None:
        return None
    try:
        stamp = json.loads((Path(resolve_model_path(model)) / MODEL_STAMP).read_text())
        registered = load_manifest().get(key)
    except (OSError, ValueError, AdapterError):
        stamp, registered = {}, None
    merged_from = str(stamp.get("adapter_sha256", ""))
    if registered is not None and merged_from == registered.sha256:
        return key
    return f"{key}#{merged_from[:12] or 'unknown'}"


class SimEngineCore(EngineCoreClient):
    """An in-process engine core whose steps take the profile's time.

    Args:
        vllm_config: the engine's ``VllmConfig`` (its limits: ``max_num_seqs``,
            ``max_loras``, ``max_cpu_loras``, ``max_lora_rank``, ``max_model_len``,
            ``scheduling_policy``).
        profile: the cost model.
        tokenizer: the model's tokenizer (vLLM's renderer's).
        model: the variant's ``model`` (names the answers: :mod:`serve_app.sim.answers`).
    """

    def __init__(self, vllm_config: Any, profile: SimProfile, tokenizer: Any,
                 model: str) -> None:
        sched = vllm_config.scheduler_config
        lora = vllm_config.lora_config
        self.profile = profile
        self.max_cpu_loras = (lora.max_cpu_loras or lora.max_loras) if lora else 0
        self.max_lora_rank = lora.max_lora_rank if lora else 0
        self.scheduler = SimScheduler(
            profile, AnswerBook(tokenizer), max_num_seqs=sched.max_num_seqs,
            max_loras=lora.max_loras if lora else 1,
            max_model_len=vllm_config.model_config.max_model_len,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            priority=sched.policy == "priority")
        # who answers a request without LoRA: the merged adapter, else the model itself
        self.base_label = merged_label(model) or model_identity(model)
        self.resources = SimpleNamespace(engine_dead=False, output_queue_task=None)
        self.engine_ranks_managed = [0]
        self.loras: OrderedDict[int, LoRARequest] = OrderedDict()  # LRU first
        self.lora_removed_in_use = 0  # remove_lora while a request used it (must stay 0)
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._last_step_end = 0.0

    # -- what AsyncLLM calls -----------------------------------------------------------------

    async def get_output_async(self) -> EngineCoreOutputs:
        if self._loop_task is None and not self.resources.engine_dead:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        if self.resources.engine_dead:
            raise EngineDeadError()
        params = request.sampling_params
        prompt = tuple(request.prompt_token_ids or ())
        lora = request.lora_request
        if lora is not None and lora.lora_int_id not in self.loras:
            await self.add_lora_async(lora)  # vLLM loads a request's adapter on demand
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.scheduler.max_model_len - len(prompt)
        self.scheduler.add(SimRequest(
            request_id=request.request_id, prompt_ids=prompt, max_tokens=max_tokens,
            label=lora.lora_name if lora else self.base_label,
            lora=lora.lora_int_id if lora else 0, lora_name=lora.lora_name if lora else "",
            priority=request.priority,
            eos=None if params.ignore_eos else params.eos_token_id,
            stop_ids=frozenset(params.stop_token_ids or ()), min_tokens=params.min_tokens,
            logprobs=params.logprobs, arrival=time.monotonic()))
        if lora is not None:
            self.loras.move_to_end(lora.lora_int_id)
        self._work.set()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.scheduler.abort(list(request_ids))

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def add_lora_async(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (``adapter_load_s``), evicting the least recently used idle one
        past ``max_cpu_loras``, as vLLM's LRU adapter cache does.

        Raises:
            ValueError: LoRA is off, or the adapter is not a PEFT adapter this engine can
                hold (vLLM's reasons: no ``adapter_config.json``, rank over
                ``max_lora_rank``).
        """
        if not self.max_cpu_loras:
            raise ValueError("LoRA is not enabled on this engine (engine_args.enable_lora)")
        if lora_request.lora_int_id in self.loras:
            self.loras.move_to_end(lora_request.lora_int_id)
            return True
        config_file = Path(lora_request.lora_path) / "adapter_config.json"
        try:
            rank = int(json.loads(config_file.read_text())["r"])
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"Loading lora {lora_request.lora_name} failed: No adapter found "
                             f"for {lora_request.lora_path} ({type(e).__name__})") from None
        if rank > self.max_lora_rank:
            raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank "
                             f"{self.max_lora_rank}.")
        await asyncio.sleep(self.profile.adapter_load_s)
        evict_idle_lru(self.loras, self.max_cpu_loras - 1, self.scheduler.loras_in_use())
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora_async(self, lora_id: int) -> bool:
        if lora_id in self.scheduler.loras_in_use():
            self.lora_removed_in_use += 1
            logger.error("simulated engine: adapter %d removed while a request uses it", lora_id)
        if self.loras.pop(lora_id, None) is None:
            return False
        await asyncio.sleep(self.profile.adapter_unload_s)
        return True

    async def list_loras_async(self) -> set[int]:
        return set(self.loras)

    async def pin_lora_async(self, lora_id: int) -> bool:
        return lora_id in self.loras

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False,
                                       reset_connector: bool = False) -> bool:
        self.scheduler.cache.reset()
        return True

    async def is_sleeping_async(self) -> bool:
        return False

    async def reset_mm_cache_async(self) -> None:
        return None

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()

    # -- drills ------------------------------------------------------------------------------

    def die(self, reason: str = "the simulated engine was told to die") -> None:
        """Die as a vLLM engine core does: every request in flight fails with
        ``EngineDeadError``, ``AsyncLLM.errored`` turns true and ``check_health`` raises."""
        logger.error("simulated engine: dying (%s)", reason)
        self.resources.engine_dead = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._outputs.put_nowait(EngineDeadError())

    def status(self) -> dict[str, Any]:
        """The engine's own state: requests waiting and running (with their adapters),
        resident adapters, and removals of an adapter in use (tests)."""
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "loras": [lr.lora_name for lr in self.loras.values()],
                "running_loras": sorted({r.lora_name for r in self.scheduler.running.values()
                                         if r.lora_name}),
                "lora_removed_in_use": self.lora_removed_in_use}

    # -- the step loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        sched = self.scheduler
        while True:
            if not sched.has_work():
                self._outputs.put_nowait(EngineCoreOutputs(scheduler_stats=self._stats(None)))
                self._work.clear()
                await self._work.wait()
                continue
            now = time.monotonic()
            step = sched.plan(now)
            # A step that follows the last one starts where it ended, so the loop's own
            # overhead does not stretch the cost model's time.
            start = self._last_step_end if now - self._last_step_end < step.seconds else now
            self._last_step_end = start + step.seconds
            await asyncio.sleep(max(0.0, self._last_step_end - time.monotonic()))
            tokens = sched.finish(step)
            if tokens or step.admitted:
                self._outputs.put_nowait(EngineCoreOutputs(
                    outputs=[self._output(t) for t in tokens],
                    scheduler_stats=self._stats(step)))

    def _output(self, token: Token) -> EngineCoreOutput:
        req = token.request
        out = EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[token.token_id],
            finish_reason=_FINISH[token.finish] if token.finish else None,
            stop_reason=token.stop_reason)
        if token.first:
            out.events = [EngineCoreEvent.new_event(EngineCoreEventType.QUEUED, req.arrival),
                          EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED,
                                                    req.scheduled_at)]
            stats = PrefillStats()
            stats.set(len(req.prompt_ids), req.cached_tokens, 0)
            out.prefill_stats = stats
        if req.logprobs is not None:
            alternatives = self.scheduler.book.words[:req.logprobs]
            ids = [token.token_id, *alternatives]
            out.new_logprobs = LogprobsLists(
                np.array([ids], dtype=np.int64),
                np.array([[0.0] + [-1.0 - i for i in range(len(alternatives))]],
                         dtype=np.float32),
                np.array([1], dtype=np.int64))
        return out

    def _stats(self, step: Step | None) -> SchedulerStats:
        sched = self.scheduler
        prefix = PrefixCacheStats()
        for req in step.admitted if step else ():
            prefix.record(num_tokens=len(req.prompt_ids), num_hits=req.cached_tokens,
                          preempted=False)
        running, waiting = {}, {}
        for counts, reqs in ((running, sched.running.values()), (waiting, sched.waiting)):
            for r in reqs:
                if r.lora_name:
                    counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
        return SchedulerStats(num_running_reqs=len(sched.running),
                              num_waiting_reqs=len(sched.waiting),
                              kv_cache_usage=sched.kv_cache_usage(),
                              prefix_cache_stats=prefix,
                              running_lora_adapters=running, waiting_lora_adapters=waiting)


class _SimCoreFactory:
    """Stands in for ``EngineCoreClient`` in ``vllm.v1.engine.async_llm`` while one
    :class:`SimAsyncLLM` is built: its ``make_async_mp_client`` returns the sim core."""

    def __init__(self, make) -> None:
        self.make_async_mp_client = make


class SimAsyncLLM(AsyncLLM):
    """vLLM's ``AsyncLLM`` on a :class:`SimEngineCore` (the core is ``self.engine_core``)."""

    def __init__(self, vllm_config: Any, *, profile: SimProfile, model: str,
                 stat_loggers: list | None = None) -> None:
        def make(vllm_config, executor_class, log_stats, *_, renderer=None, **__):
            return SimEngineCore(vllm_config, profile, renderer.tokenizer, model)

        # AsyncLLM builds its engine-core client with a module-level name; swap it only
        # while this (synchronous) constructor runs.
        real = async_llm_module.EngineCoreClient
        async_llm_module.EngineCoreClient = _SimCoreFactory(make)
        try:
            super().__init__(vllm_config, executor_class=None, log_stats=True,
                             stat_loggers=stat_loggers)
        finally:
            async_llm_module.EngineCoreClient = real


async def start_sim_async_llm(args: Any, vllm_config: Any,
                              stat_loggers: list | None = None) -> SimAsyncLLM:
    """Start a :class:`SimAsyncLLM` for a variant's ``args`` (:class:`VariantArgs` with
    ``engine: sim``): wait ``args.sim.start_s`` (else the profile's ``engine_start_s``),
    then build it.

    Raises:
        RuntimeError: ``args.sim.fail_start`` is set (the engine "fails to start").
    """
    from serve_app.common.config import SimArgs
    from serve_app.common.sim_profile import load_profile

    sim = args.sim or SimArgs()
    profile = load_profile(sim.profile).scaled(sim.time_scale)
    await asyncio.sleep(profile.engine_start_s if sim.start_s is None else sim.start_s)
    if sim.fail_start:
        raise RuntimeError(f"the simulated engine failed to start: {sim.fail_start}")
    logger.info("simulated engine (profile %s, time_scale %g) for model %s: no weights "
                "loaded", profile.name, sim.time_scale, args.model)
    return SimAsyncLLM(vllm_config, profile=profile, model=args.model,
                       stat_loggers=stat_loggers)
