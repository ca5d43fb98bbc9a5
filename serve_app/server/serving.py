"""``ReplicaServer``: the serving logic of one variant replica, over an engine protocol.

``LLMReplica`` (:mod:`serve_app.replica`) is the Serve deployment shell; everything it does
with a request happens here, against a :class:`ServingEngine` (the replica's
:class:`~serve_app.server.engine_protocol.Engine`, or a fake in unit tests; the seam Ray Serve
LLM's ``LLMServer(engine_cls=...)`` has). Per request (:meth:`ReplicaServer.generate`):

1. :class:`~serve_app.common.wire.Accepted` first for a non-stream, and for a stream that
   must wait for its adapter (the router time-boxes the first item);
2. an injected fault, if ``user_config.fault_injection`` says so (tests and drills);
3. the adapter: take the version the router chose from the :class:`AdapterSet` (404 for one
   not declared), loaded on first use, held until the request ends so it is never unloaded
   under it;
4. the engine call on :func:`~serve_app.server.openai_body.engine_body`;
5. every failure classified (:mod:`serve_app.common.failures`) into a :class:`Head`, or,
   once a stream has started, into its :class:`Tail`; nothing raises to the caller.

Streamed lines go through :func:`~serve_app.server.coalesce.coalesce` (one Ray message per
``stream_batching_interval_ms``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pydantic import ValidationError

from serve_app.common.adapters import AdapterError, adapter_name, manifest_file
from serve_app.common.config import ReplicaConfig
from serve_app.common.errors import (MeshError, error_body, format_validation_error,
                                     reject_user_config)
from serve_app.common.failures import Failure, Verdict, replica_verdict, stream_error_verdict
from serve_app.common.logs import get_logger
from serve_app.common.wire import (REPLICA_HEADER, Accepted, GenerateRequest, Head, ReplicaInfo,
                                   Tail, Usage, sse_error)
from serve_app.control.resident_policy import EVICTED, IDLE_S, IN_FLIGHT
from serve_app.server.coalesce import coalesce
from serve_app.server.lora import ADAPTER_CAPACITY, AdapterSet
from serve_app.server.openai_body import (StreamUsage, UsageWanted, engine_body, for_client,
                                          in_band_error, usage_chunk, wants_structured_output)

logger = get_logger(__name__)


@dataclass(frozen=True)
class EngineAnswer:
    """A whole (non-streaming) answer: the OpenAI response JSON and its token counts."""

    body: str
    usage: Usage | None = None


@dataclass(frozen=True)
class EngineError:
    """An error the engine's OpenAI layer answered with (vLLM's ``ErrorResponse``).

    Attributes:
        code: HTTP status. message: what was wrong. param: the field at fault, if known.
    """

    code: int
    message: str
    param: str | None = None


class ServingEngine(Protocol):
    """What :class:`ReplicaServer` needs of an engine: the part of
    :class:`~serve_app.server.engine_protocol.Engine` it uses (unit tests give it a fake)."""

    max_num_seqs: int
    max_model_len: int
    priority_scheduling: bool

    @property
    def errored(self) -> bool:
        """The engine has died (vLLM ``AsyncLLM.errored``)."""

    async def run(self, endpoint: str, body: dict[str, Any]
                  ) -> EngineAnswer | EngineError | AsyncIterator[str]:
        """Serve one OpenAI body: a whole answer, an error, or SSE lines.

        Raises:
            Exception: anything; :func:`~serve_app.common.failures.replica_verdict`
                classifies it.
        """

    def num_unfinished(self) -> int:
        """Requests the engine still holds."""


class ReplicaServer:
    """Serves one variant's requests on one engine.

    Args:
        variant: the variant's application name (for messages and logs).
        engine: the engine (:class:`ServingEngine`).
        adapters: the replica's adapter set (declared adapters, resident in ``engine``).
        replica: the Serve replica id, sent back on every head (``x-mesh-replica``).
        merged: the adapter version (``name@vN``) merged into the engine's model
            (:func:`~serve_app.common.adapters.merged_adapter`): requests for it run on the
            model's own weights, no LoRA; "" for none.
        rng: the random source of fault injection (seeded in tests).
    """

    def __init__(self, variant: str, engine: ServingEngine, adapters: AdapterSet, *,
                 replica: str = "", merged: str = "", rng: random.Random | None = None) -> None:
        self.variant = variant
        self.replica = replica
        self.merged = merged
        self.engine = engine
        self.adapters = adapters
        self.config: ReplicaConfig | None = None
        self.in_flight = 0  # requests inside generate()
        self.idle_since = time.monotonic()  # when in_flight last fell to 0
        self.evicted_until = 0.0  # monotonic time the resident budget's eviction stands until
        self.full_batch_service_s = 0.0  # the engine's start-up calibration (LLMReplica sets it)
        self._rng = rng or random.Random()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Validate and apply a new ``user_config``; an invalid one changes nothing.

        With a previous config the rejection is logged and the last good config kept
        (raising would make Serve replace a healthy replica); without one it raises, so a bad
        first deploy fails visibly. The adapter set is then reconciled in place
        (:meth:`AdapterSet.reconcile`): a broken adapter is refused on its own.

        Raises:
            ValueError: invalid ``user_config`` and no previous one.
        """
        try:
            new = ReplicaConfig.model_validate(user_config or {})
        except ValidationError as e:
            return reject_user_config(self.config, f"variant {self.variant}: invalid LLMReplica "
                                      f"user_config:\n{format_validation_error(e, 'user_config')}")
        try:  # a registry in a bucket or on the hub is fetched (again) now
            manifest = await asyncio.to_thread(manifest_file, new.adapters_manifest) \
                if new.adapters_manifest and new.adapters else None
            await self.adapters.reconcile([(a.name, a.version) for a in new.adapters], manifest,
                                          new.max_adapters_per_replica)
        except AdapterError as e:
            return reject_user_config(self.config, f"variant {self.variant}: {e}")
        if new.fault_injection:
            logger.warning("variant %s: FAULT INJECTION ON (testing only): %s", self.variant,
                           new.fault_injection.model_dump())
        self.config = new

    def stats(self) -> dict[str, Any]:
        """``in_flight`` (requests inside :meth:`generate`), ``engine_unfinished`` (requests
        the engine still holds) and the adapter set's status."""
        return {"variant": self.variant, "in_flight": self.in_flight,
                "engine_unfinished": self.engine.num_unfinished(),
                "adapters": self.adapters.status()}

    def evict(self, for_s: float) -> None:
        """The router's resident budget evicts this replica for ``for_s`` seconds (0: it gave
        up on the eviction). With the resident-budget policy, Serve stops an evicted replica
        once it has no request in flight (after ``downscale_to_zero_delay_s``). The eviction
        lapses by itself, so a router that gave up, or died, does not leave it standing."""
        evicted = for_s > 0
        if evicted != (self.evicted_until > time.monotonic()):
            logger.info("variant %s: %s", self.variant,
                        "evicted by the router's resident budget; stopping once idle"
                        if evicted else "no longer evicted; staying")
        self.evicted_until = time.monotonic() + for_s if evicted else 0.0

    def autoscaling_stats(self) -> dict[str, float]:
        """What the resident-budget autoscaling policy reads
        (:mod:`serve_app.control.resident_policy`): requests in flight, seconds idle (0 while
        any is in flight; the router's polls do not count) and whether an eviction stands."""
        now = time.monotonic()
        idle_s = 0.0 if self.in_flight else now - self.idle_since
        return {IN_FLIGHT: float(self.in_flight), IDLE_S: round(idle_s, 3),
                EVICTED: float(now < self.evicted_until)}

    def serving_info(self) -> ReplicaInfo:
        """Adapter versions that take new requests here and the engine's scheduling facts."""
        return ReplicaInfo(adapters=tuple(sorted({*self.adapters.serving(),
                                                  *([self.merged] if self.merged else [])})),
                           max_num_seqs=self.engine.max_num_seqs,
                           priority_scheduling=self.engine.priority_scheduling,
                           defaults=tuple(sorted(self.adapters.default.values())),
                           merged=self.merged,
                           full_batch_service_s=self.full_batch_service_s,
                           max_model_len=self.engine.max_model_len,
                           replica=self.replica)

    async def generate(self, request: GenerateRequest
                       ) -> AsyncIterator[Accepted | Head | str | Tail]:
        """Serve one request; the stream the router reads (:mod:`serve_app.common.wire`):
        :class:`Accepted` (non-streams, and streams that wait for their adapter), a :class:`Head` (with ``x-mesh-replica`` and, for
        an adapter request, ``x-mesh-adapter: name@vN``), then, for a stream, SSE lines
        and a :class:`Tail`. Raises nothing: every failure is an error head, or mid-stream
        an in-band error event and a failed tail."""
        async with aclosing(self._serve(request)) as answer:
            async for item in answer:
                if isinstance(item, Head):
                    item = replace(item, headers={**item.headers, REPLICA_HEADER: self.replica})
                yield item

    async def _serve(self, request: GenerateRequest
                     ) -> AsyncIterator[Accepted | Head | str | Tail]:
        self.in_flight += 1
        live = None
        try:
            if not request.body.get("stream"):
                yield Accepted()
            if fault := await self._injected_fault():
                yield fault
                return
            requested = str(request.body.get("model"))
            route, _, adapter = requested.partition(":")
            if adapter and self._serves_merged(request.adapter_version or adapter):
                # the model's own weights are this adapter: no LoRA, the base's speed
                async with aclosing(self._generate(request, route)) as items:
                    async for item in items:
                        yield for_client(item, route, requested, self.merged)
                return
            if adapter:
                version = request.adapter_version or adapter
                if request.body.get("stream") and not self.adapters.ready(version):
                    # It may wait for an adapter slot up to queue_timeout_s: tell the router
                    # the replica has it, so the wait is not taken for an unreachable replica.
                    yield Accepted()
                try:
                    live = await self.adapters.acquire(version, wait_s=request.queue_timeout_s)
                except MeshError as e:  # 404: not declared; 503: no room, or the load failed
                    yield Head(e.status, json.dumps(e.body()), headers=e.headers,
                               failure=self._adapter_failure(e, adapter))
                    return
            # Closed here, before the adapter is released below: the engine request stops
            # (vLLM aborts it as its generator closes) before the adapter may be unloaded.
            async with aclosing(self._generate(request, live.lora_name if live else None)
                                ) as items:
                async for item in items:
                    yield for_client(item, live.lora_name, requested, live.lora_name) \
                        if live else item
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle_since = time.monotonic()
            if live is not None:
                self.adapters.release(live)

    def _adapter_failure(self, e: MeshError, adapter: str) -> Failure:
        """The kind of an adapter refusal: ``adapter_capacity`` is the replica being busy
        (:data:`Failure.CAPACITY`); a 404 is the client's (on a merged variant, another
        version of its adapter is the router's stale view: a variant failure, so the LoRA
        path serves it); a failed load is the variant's."""
        if e.code == ADAPTER_CAPACITY:
            return Failure.CAPACITY
        stale = self.merged and adapter_name(self.merged) == adapter
        return Failure.REQUEST if e.status < 500 and not stale else Failure.VARIANT

    def _serves_merged(self, adapter: str) -> bool:
        """``adapter`` (``name`` or ``name@vN``) is the version merged into the model."""
        return bool(self.merged) and adapter in (self.merged, adapter_name(self.merged))

    async def _injected_fault(self) -> Head | None:
        """``user_config.fault_injection``: maybe sleep, maybe fail as a variant failure
        would (the router fails over, a rollout counts it)."""
        fault = self.config.fault_injection if self.config else None
        if fault is None:
            return None
        if fault.delay_ms and self._rng.random() < fault.delay_rate:
            await asyncio.sleep(fault.delay_ms / 1000)
        if self._rng.random() < fault.error_rate:
            return Head(503, json.dumps(error_body(
                503, f"injected fault: variant {self.variant} has user_config.fault_injection."
                f"error_rate {fault.error_rate} (a test or drill setting)",
                code="injected_fault")), failure=Failure.VARIANT)
        return None

    def _classify(self, body: dict[str, Any], exc: BaseException | None, code: int = 500,
                  message: str = "") -> Verdict:
        """An exception's verdict; with ``exc`` None, the verdict on an error the engine
        reported with ``code`` and ``message`` (an :class:`EngineError` or an in-band event)."""
        facts = dict(variant=self.variant, engine_is_dead=self.engine.errored,
                     structured_output=wants_structured_output(body))
        if exc is not None:
            return replica_verdict(exc, **facts)
        if 400 <= code < 500:
            return Verdict(Failure.REQUEST, code, message)
        return stream_error_verdict(code, message, **facts)

    def _verdict_head(self, verdict: Verdict) -> Head:
        if verdict.failure is not Failure.REQUEST:
            logger.warning("variant %s: %s (%d): %s", self.variant, verdict.failure.value,
                           verdict.status, verdict.message[:500])
        # No Retry-After here: a variant failure never reaches the client as it is (the
        # router fails over, and answers 503 with its own Retry-After when none is left).
        return Head(verdict.status, json.dumps(verdict.body()), failure=verdict.failure)

    async def _generate(self, request: GenerateRequest, engine_model: str | None
                        ) -> AsyncIterator[Head | str | Tail]:
        body, client_wants_usage = engine_body(
            request, model=engine_model, priority_scheduling=self.engine.priority_scheduling,
            system_prompt=self.config.system_prompt if self.config else None)
        try:
            result = await self.engine.run(request.endpoint, body)
        except Exception as e:  # noqa: BLE001 -- every error is classified, none escapes
            yield self._verdict_head(self._classify(body, e))
            return
        if isinstance(result, EngineError):  # vLLM's own verdict (4xx, or a 5xx)
            verdict = self._classify(body, None, code=result.code, message=result.message)
            yield self._verdict_head(replace(verdict, param=result.param)
                                     if verdict.failure is Failure.REQUEST else verdict)
        elif isinstance(result, EngineAnswer):
            yield Head(200, result.body, usage=result.usage)
        else:
            yield Head(200, stream=True)
            interval_s = (self.config.stream_batching_interval_ms if self.config else 0) / 1000
            async with aclosing(coalesce(self._stream(result, body, client_wants_usage),
                                         interval_s, attach=_with_text)) as items:
                async for item in items:
                    yield item

    async def _stream(self, lines: AsyncIterator[str], body: dict[str, Any],
                      client_wants_usage: UsageWanted) -> AsyncIterator[str | Tail]:
        """The engine's SSE lines as the client gets them, each a
        :class:`~serve_app.common.wire.StreamText` with the tokens so far (each chunk's own
        usage taken out unless the client asked for it), then the :class:`Tail`: usage from
        the usage chunk (passed on only if the client asked for it), and the kind of an
        in-band error event the engine ended the stream with."""
        tail = Tail()
        progress = StreamUsage(body, keep=bool(client_wants_usage & UsageWanted.CONTINUOUS))
        # vLLM's role-only first chunk(s) (a chat's), yielded with the first token's: held
        # and sent with it, one message fewer for every stream
        role, first = "", True
        try:
            async for line in _closing(lines):
                if first and _role_only(line):
                    role += progress.take(line)
                    continue
                first = False
                if (error := in_band_error(line)) is not None:
                    verdict = self._classify(body, None, code=int(error.get("code") or 500),
                                             message=str(error.get("message")))
                    tail = replace(tail, failure=verdict.failure, message=verdict.message)
                elif (u := usage_chunk(line)) is not None:
                    tail = replace(tail, usage=Usage(u["prompt_tokens"],
                                                     u.get("completion_tokens") or 0))
                    if not client_wants_usage:
                        line = ""
                else:
                    line = progress.take(line)
                line, role = role + line, ""
                if line:
                    yield progress.text(line)
        except Exception as e:  # noqa: BLE001 -- vLLM's generator normally catches these
            verdict = self._classify(body, e)
            tail = replace(tail, failure=verdict.failure, message=verdict.message)
            role += sse_error(verdict.body())
        if role:  # a stream that ended before its first token
            yield progress.text(role)
        if tail.failure is not None and tail.failure is not Failure.REQUEST:
            logger.warning("variant %s: stream ended with an in-band error (%s): %s",
                           self.variant, tail.failure.value, tail.message[:500])
        yield tail


#: How a chat's role-only first chunk looks in vLLM's SSE (``DeltaMessage(role=..,
#: content="")``, dumped with ``exclude_unset``).
_ROLE_DELTA, _EMPTY_CONTENT = '"delta":{"role":"', '","content":""}'


def _role_only(line: str) -> bool:
    """``line`` is a chat's role-only chunk: a role and empty content, nothing else."""
    return _ROLE_DELTA in line and _EMPTY_CONTENT in line and '"finish_reason":null' in line


def _with_text(text: str, tail: Tail) -> Tail:
    """The stream's last text sent with its :class:`Tail`, in one message."""
    return replace(tail, text=text)


async def _closing(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """``lines`` (vLLM's SSE generator), closed when this generator is: closing it is what
    makes vLLM abort the engine request, so it must not wait for garbage collection."""
    async with aclosing(lines) as items:
        async for line in items:
            yield line
