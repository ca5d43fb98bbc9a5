"""``LLMReplica``: the Serve deployment of a variant application, wrapping one vLLM engine.

One replica = one ``AsyncLLM`` engine (plus its engine-core worker process). It is called
only by the router, through a ``DeploymentHandle``; see :mod:`serve_app.wire` for the stream
it returns. Engine arguments come from the application's ``args`` (:class:`VariantArgs`,
changing them restarts replicas); the ``user_config`` (:class:`ReplicaConfig`) is applied in
place by ``reconfigure()``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import AsyncIterator
from typing import Any

from dataclasses import replace

from pydantic import ValidationError
from ray import serve
from ray.util.metrics import Counter

from serve_app.common.adapters import AdapterError
from serve_app.common.config import ReplicaConfig, VariantArgs
from serve_app.server.engine_reaper import start_reaper
from serve_app.server.engine import EngineHandle, engine_config, start_engine
from serve_app.common.errors import (MeshError, error_body, format_validation_error,
                                     reject_user_config)
from serve_app.server.coalesce import coalesce
from serve_app.server.lora import AdapterSet
from serve_app.common.paths import resolve_repo_path
from serve_app.release.validate import SURGE_PERCENT
from serve_app.common.failures import Failure, Verdict, replica_verdict, stream_error_verdict
from serve_app.common.wire import ADAPTER_HEADER, Accepted, Head, ReplicaInfo, Tail, Usage

logger = logging.getLogger("ray.serve")

#: How vLLM's stream generators start an in-band error event (then ``data: [DONE]``).
IN_BAND_ERROR = 'data: {"error"'
SSE_DONE = "data: [DONE]\n\n"
#: Seconds a client should wait before retrying after a variant failure.
RETRY_AFTER_S = 2
#: Ray resources of one replica when the config gives no ``ray_actor_options`` (a config's own
#: ``ray_actor_options`` replaces these whole). Small enough for two variants and the router on
#: a 2-core host; GPU hosts set ``{num_cpus: 1, num_gpus: 1}`` in the config (README).
#: ``meshctl kuberay`` sizes worker pods from the same values.
REPLICA_ACTOR_OPTIONS = {"num_cpus": 0.5}


@serve.deployment(
    name="LLMReplica",
    # A full generation must fit: max_tokens at ~30 tokens/s on CPU, with headroom.
    graceful_shutdown_timeout_s=300,
    graceful_shutdown_wait_loop_s=1,
    health_check_period_s=2,  # three failures in a row (a dead engine) replace it in ~6 s
    health_check_timeout_s=60,
    # The router admits at most max_num_seqs requests per replica (serve_app.ingress.admission);
    # these are Serve's own bounds behind it: requests past them fail over at once
    # (BackPressureError) instead of queueing without end.
    max_ongoing_requests=64,
    max_queued_requests=64,
    # Start a replacement before stopping the old replica, so a changed `args` or a bad
    # deploy never leaves the variant with no replica (a failed replacement leaves the old
    # one serving).
    max_surge_percent=SURGE_PERCENT,
    ray_actor_options=dict(REPLICA_ACTOR_OPTIONS),
)
class LLMReplica:
    """A vLLM engine serving OpenAI chat completions and completions for one variant.

    Args:
        args: the variant application's ``args`` (see :class:`VariantArgs`).

    Raises:
        pydantic.ValidationError / ValueError / FileNotFoundError: bad ``args`` or a missing
            model; Serve reports the deploy as failed and keeps serving what ran before.
    """

    async def __init__(self, args: dict[str, Any]):
        self.args = VariantArgs.model_validate(args)
        self.config: ReplicaConfig | None = None
        self._in_flight = 0
        ctx = serve.get_replica_context()
        self.variant = ctx.app_name
        logger.info("variant %s: starting vLLM engine for model %s", self.variant, self.args.model)
        self._reaper = start_reaper()  # stops the engine's processes should this one die first
        self.handle: EngineHandle = await start_engine(self.args)
        logger.info("variant %s: engine ready (max_model_len=%d)", self.variant,
                    self.handle.max_model_len)
        self._adapter_events = Counter("mesh_adapter_events", "Adapter loads, unloads and "
                                       "refusals.", tag_keys=("variant", "adapter", "event"))
        self.adapters = AdapterSet(
            self.handle.models, self.handle.engine, base_model=self.args.model,
            max_lora_rank=self.handle.max_lora_rank,
            on_event=lambda key, event: self._adapter_events.inc(
                1, {"variant": self.variant, "adapter": key, "event": event}))

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Validate and apply a new ``user_config``; an invalid one changes nothing.

        A running replica logs the rejection and keeps its last good config (raising here
        would make Serve replace a healthy replica). A replica that has no config yet
        raises, so a bad first deploy fails visibly. The adapter set is then reconciled in
        place (:meth:`AdapterSet.reconcile`): a broken adapter is refused on its own.

        Raises:
            ValueError: invalid ``user_config`` on a replica without a previous one.
        """
        try:
            new = ReplicaConfig.model_validate(user_config or {})
        except ValidationError as e:
            return reject_user_config(self.config, f"variant {self.variant}: invalid LLMReplica "
                                      f"user_config:\n{format_validation_error(e, 'user_config')}")
        manifest = resolve_repo_path(new.adapters_manifest) if new.adapters_manifest else None
        try:
            await self.adapters.reconcile([(a.name, a.version) for a in new.adapters], manifest)
        except AdapterError as e:
            return reject_user_config(self.config, f"variant {self.variant}: {e}")
        if new.fault_injection:
            logger.warning("variant %s: FAULT INJECTION ON (testing only): %s", self.variant,
                           new.fault_injection.model_dump())
        self.config = new

    async def check_health(self) -> None:
        """Serve health check: raises if the engine is dead (Serve then replaces the replica)."""
        await self.handle.engine.check_health()

    async def stats(self) -> dict[str, Any]:
        """Replica state for tests and debugging.

        Returns:
            ``variant``, ``pid``, ``in_flight`` (requests inside :meth:`generate`) and
            ``engine_unfinished`` (requests vLLM's engine still holds).
        """
        return {"variant": self.variant, "pid": os.getpid(), "in_flight": self._in_flight,
                "engine_unfinished": self.handle.engine.get_num_unfinished_requests(),
                "adapters": self.adapters.status()}

    async def serving_info(self) -> ReplicaInfo:
        """Adapter versions that take new requests here (the router routes ``route:adapter``
        by them) and the engine's scheduling facts (the router's admission slots)."""
        return ReplicaInfo(adapters=tuple(sorted(self.adapters.active)),
                           max_num_seqs=self.handle.max_num_seqs,
                           priority_scheduling=self.handle.priority_scheduling)

    async def generate(self, endpoint: str, body: dict[str, Any],
                       adapter_version: str | None = None, priority: int = 0,
                       request_id: str | None = None) -> AsyncIterator[Head | str | Tail]:
        """Run one OpenAI request (``endpoint``: ``"chat"`` or ``"completion"``).

        ``body["model"]`` is ``route`` or ``route:adapter``; ``adapter_version`` (``name@vN``)
        is the version an adapter split chose, else the adapter's default version serves.
        ``priority`` is the tenant's (vLLM convention: lower is served first); it reaches
        vLLM when the engine runs ``scheduling_policy: priority``. ``request_id`` (the
        router's ``x-request-id``) becomes vLLM's request id (``chatcmpl-<id>``).

        Yields :class:`Accepted` first if it is not a stream, then a :class:`Head` (with
        ``x-mesh-adapter: name@vN`` for adapter requests), then SSE text and a :class:`Tail`
        if it is a stream. Nothing raises to the caller: every
        failure becomes an error head (or, mid-stream, an in-band error event and a failed
        tail) classified by :mod:`serve_app.failures`.
        """
        self._in_flight += 1
        live = None
        try:
            if not body.get("stream"):
                yield Accepted()
            if fault := await self._injected_fault():
                yield fault
                return
            requested = body.get("model")
            _, _, adapter = str(requested).partition(":")
            if adapter:
                try:
                    live = self.adapters.acquire(adapter_version or adapter)
                except MeshError as e:
                    yield Head(e.status, _json(e.body()), failure=Failure.REQUEST)
                    return
                body = {**body, "model": live.lora_name}
            if self.handle.priority_scheduling:
                body = {**body, "priority": priority}
            if request_id:
                body = {**body, "request_id": request_id}
            async for item in self._generate(endpoint, body):
                yield _for_client(item, live, requested) if live else item
        finally:
            self._in_flight -= 1
            if live is not None:
                self.adapters.release(live)

    async def _injected_fault(self) -> Head | None:
        """``user_config.fault_injection`` (tests and drills): maybe sleep, maybe fail as a
        variant failure would (the router fails over, a rollout counts it)."""
        fault = self.config.fault_injection if self.config else None
        if fault is None:
            return None
        if fault.delay_ms and random.random() < fault.delay_rate:
            await asyncio.sleep(fault.delay_ms / 1000)
        if random.random() < fault.error_rate:
            return Head(503, _json(error_body(
                503, f"injected fault: variant {self.variant} has user_config.fault_injection."
                f"error_rate {fault.error_rate} (a test or drill setting)",
                code="injected_fault")), failure=Failure.VARIANT)
        return None

    def _verdict_head(self, verdict: Verdict) -> Head:
        if verdict.failure is not Failure.REQUEST:
            logger.warning("variant %s: %s (%d): %s", self.variant, verdict.failure.value,
                           verdict.status, verdict.message[:500])
        return Head(verdict.status, _json(verdict.body()), failure=verdict.failure,
                    headers={"Retry-After": str(RETRY_AFTER_S)}
                    if verdict.failure is Failure.VARIANT else {})

    async def _generate(self, endpoint: str, body: dict[str, Any]
                        ) -> AsyncIterator[Head | str | Tail]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        structured = wants_structured_output(body)

        def classify(exc: BaseException | None, code: int = 500, message: str = "") -> Verdict:
            """An exception's verdict; with ``exc`` None, an error vLLM reported with
            ``code`` and ``message`` (an ``ErrorResponse`` or an in-band event)."""
            facts = dict(variant=self.variant, engine_is_dead=self.handle.engine.errored,
                         structured_output=structured)
            if exc is not None:
                return replica_verdict(exc, **facts)
            if 400 <= code < 500:
                return Verdict(Failure.REQUEST, code, message)
            return stream_error_verdict(code, message, **facts)

        protocol = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        if endpoint == "chat":
            body = self._with_system_prompt(body)
        # Streams always carry usage (for the router's token metrics); the usage chunk is
        # passed to the client only if it asked for it.
        options = body.get("stream_options")
        client_wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        if body.get("stream") and (options is None or isinstance(options, dict)):
            body = {**body, "stream_options": {**(options or {}), "include_usage": True}}
        serving = self.handle.chat.create_chat_completion if endpoint == "chat" \
            else self.handle.completion.create_completion
        try:
            result = await serving(protocol.model_validate(body), None)
        except Exception as e:  # noqa: BLE001 -- every error is classified, none escapes
            yield self._verdict_head(classify(e))
            return
        if isinstance(result, ErrorResponse):  # vLLM's own verdict (4xx, or a 5xx)
            err = result.error
            verdict = classify(None, code=err.code, message=err.message)
            yield self._verdict_head(replace(verdict, param=err.param)
                                     if verdict.failure is Failure.REQUEST else verdict)
        elif hasattr(result, "model_dump_json"):
            u = result.usage
            yield Head(200, result.model_dump_json(),
                       usage=Usage(u.prompt_tokens, u.completion_tokens or 0) if u else None)
        else:
            yield Head(200, stream=True)
            interval_s = (self.config.stream_batching_interval_ms if self.config else 0) / 1000
            async for item in coalesce(self._stream(result, client_wants_usage, classify),
                                       interval_s):
                yield item

    async def _stream(self, lines: AsyncIterator[str], client_wants_usage: bool, classify
                      ) -> AsyncIterator[str | Tail]:
        """vLLM's SSE lines as the client gets them, then the :class:`Tail`: usage taken
        from vLLM's usage chunk (passed on only if the client asked for it), and the kind of
        an in-band error event vLLM ended the stream with."""
        tail = Tail()
        try:
            async for line in lines:
                if line.startswith(IN_BAND_ERROR):
                    error = json.loads(line[len("data: "):])["error"]
                    verdict = classify(None, code=int(error.get("code") or 500),
                                       message=str(error.get("message")))
                    tail = replace(tail, failure=verdict.failure, message=verdict.message)
                elif _is_usage_chunk(line):
                    u = json.loads(line[len("data: "):])["usage"]
                    tail = replace(tail, usage=Usage(u["prompt_tokens"],
                                                     u.get("completion_tokens") or 0))
                    if not client_wants_usage:
                        continue
                yield line
        except Exception as e:  # noqa: BLE001 -- vLLM's generator normally catches these
            verdict = classify(e)
            tail = replace(tail, failure=verdict.failure, message=verdict.message)
            yield f"data: {_json(verdict.body())}\n\n{SSE_DONE}"
        if tail.failure is not None and tail.failure is not Failure.REQUEST:
            logger.warning("variant %s: stream ended with an in-band error (%s): %s",
                           self.variant, tail.failure.value, tail.message[:500])
        yield tail

    def _with_system_prompt(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        prompt = self.config.system_prompt if self.config else None
        if not prompt or not isinstance(messages, list):
            return body
        if any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in messages):
            return body
        return {**body, "messages": [{"role": "system", "content": prompt}, *messages]}

    def __del__(self):
        # Serve calls this after draining in-flight requests (graceful_shutdown_timeout_s).
        handle = getattr(self, "handle", None)
        if handle is not None:
            handle.engine.shutdown()


def _for_client(item: Head | str | Tail, live, requested: str):
    """vLLM names the LoRA (``name@vN``) as ``model`` in its JSON: show what the client asked
    instead, and say which version served in the ``x-mesh-adapter`` header."""
    old, new = f'"model":"{live.lora_name}"', f'"model":"{requested}"'
    if isinstance(item, str):
        return item.replace(old, new)
    if isinstance(item, Head):
        return replace(item, body=item.body.replace(old, new) if item.body else item.body,
                       headers={**item.headers, ADAPTER_HEADER: live.lora_name})
    return item


def wants_structured_output(body: dict[str, Any]) -> bool:
    """Whether the request asks for structured output (OpenAI ``response_format`` other
    than text, vLLM's ``structured_outputs`` or its older ``guided_*`` fields)."""
    fmt = body.get("response_format")
    return (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or bool(
        body.get("structured_outputs")) or any(
        body.get(k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"))


def _is_usage_chunk(line: str) -> bool:
    # vLLM sends usage as a final chunk with empty choices; parse only that one.
    return line.startswith("data: {") and '"choices":[]' in line and '"usage":{' in line


def _json(obj: Any) -> str:
    return json.dumps(obj)


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder for a variant: ``import_path: serve_app.replica:build_app``.

    Checks ``args`` with our schema and then with vLLM's own engine-config checks before
    any replica is touched, so a bad value (say ``max_model_len`` beyond the model's) fails
    the deploy as ``DEPLOY_FAILED`` with vLLM's message, and the running replicas keep
    serving. Serve runs this in its build task (~20 s: it imports vLLM).

    Raises:
        ValueError: invalid ``args`` or engine arguments (the message names the field).
    """
    checked = VariantArgs.model_validate(args)
    try:
        engine_config(checked)
    except ValueError as e:
        raise ValueError(f"invalid engine_args for model {checked.model!r}: {e}") from None
    return LLMReplica.bind(args)
