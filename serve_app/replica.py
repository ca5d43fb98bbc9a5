"""``LLMReplica``: the Serve deployment shell of a variant application.

One replica = one engine (:class:`~serve_app.server.engine_protocol.Engine`, of the class
``args.engine`` names, chosen once at start: :func:`~serve_app.server.engine.engine_cls_for`)
and the :class:`~serve_app.server.serving.ReplicaServer` that serves on it. The shell wires
Serve to them (replica context, engine reaper, engine start, Ray metrics, the engine's
drills by name) and nothing else. The router calls :meth:`LLMReplica.generate` by handle with
one :class:`~serve_app.common.wire.GenerateRequest`. ``args`` (:class:`VariantArgs`) are the
engine's (a change restarts replicas); ``user_config`` is applied in place by
``reconfigure()``; Serve options: :mod:`serve_app.common.deployment_options`.
"""

from __future__ import annotations

import asyncio

import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray import serve
from ray.util.metrics import Counter, Gauge, Histogram

from serve_app.common.adapters import merged_adapter
from serve_app.common.config import VariantArgs
from serve_app.common.deployment_options import options, replica_options
from serve_app.common.fetch import cached_model, fetch_model
from serve_app.common.sources import parse_source
from serve_app.common.logs import get_logger
from serve_app.common.wire import CALIBRATION_TOKENS, GenerateRequest, ReplicaInfo
from serve_app.server.drills import run_drill
from serve_app.server.engine import engine_config, start_engine
from serve_app.server.engine_checks import accepted_before, remember_accepted
from serve_app.server.engine_reaper import start_reaper
from serve_app.variant_ingress import INGRESS_OPTIONS, VariantIngress
from serve_app.server.lora import AdapterSet
from serve_app.server.serving import ReplicaServer

logger = get_logger(__name__)

#: Longest the start-up full-batch measure may take, s (about 4 s on a 2-core host).
CALIBRATION_TIMEOUT_S = 60


class LLMReplica:
    """One variant's replica. ``args``: the application's (:class:`VariantArgs`).

    The model is fetched first when it comes from the hub or a bucket (once per node, into
    the cache other replicas reuse: :mod:`serve_app.common.fetch`), with progress in the
    replica's log.

    Raises:
        pydantic.ValidationError / ValueError / FileNotFoundError: bad ``args`` or a missing
            model; FetchError: the model could not be fetched (the reason is in the message).
            Serve reports the start as failed and keeps serving what ran before; requests
            held for a cold start of this variant get 503 ``cold_start_failed`` with it.
    """

    async def __init__(self, args: dict[str, Any]):
        checked = VariantArgs.model_validate(args)
        variant = serve.get_replica_context().app_name
        model_dir = await asyncio.to_thread(fetch_model, checked.model, checked.revision)
        logger.info("variant %s: starting the %s engine for model %s", variant, checked.engine,
                    checked.model)
        self._reaper = start_reaper()  # stops the engine's processes should this one die first
        self.engine = await start_engine(checked)  # its class: engine_cls_for(checked)
        logger.info("variant %s: engine ready (max_model_len=%d)", variant,
                    self.engine.max_model_len)
        replica = serve.get_replica_context().replica_id.unique_id
        adapters = AdapterSet(
            self.engine.models, self.engine.engine_client, base_model=checked.model,
            max_lora_rank=self.engine.max_lora_rank, max_cpu_loras=self.engine.max_cpu_loras,
            base_revision=checked.revision)
        self._adapter_metrics = adapters.on_event = AdapterMetrics(variant, replica, adapters)
        self.server = ReplicaServer(variant, self.engine, adapters, replica=replica,
                                    merged=merged_adapter(str(model_dir)) or "")
        # What a full batch costs, for the router's admission (its queue bound and wait
        # estimate) before it has seen this variant under load.
        try:  # a failed measure must not fail the replica: admission then uses its prior
            self.server.full_batch_service_s = await asyncio.wait_for(
                self.engine.full_batch_service_s(), CALIBRATION_TIMEOUT_S)
        except Exception as e:
            logger.warning("variant %s: the start-up full-batch measure failed (%s: %s)",
                           variant, type(e).__name__, str(e)[:300])
        else:
            logger.info("variant %s: a full batch of %d requests of %d tokens took %.2f s",
                        variant, self.engine.max_num_seqs, CALIBRATION_TOKENS,
                        self.server.full_batch_service_s)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """:meth:`ReplicaServer.reconfigure` (raises ValueError only on a first config), after
        the engine's drills' delay (``args.sim.reconfigure_s`` on the simulated engine)."""
        if self.engine.drills is not None:
            await self.engine.drills.before_reconfigure()
        await self.server.reconfigure(user_config)

    async def check_health(self) -> None:
        """Serve health check: raises if the engine is dead (Serve then replaces the replica)."""
        await self.engine.check_health()

    async def stats(self) -> dict[str, Any]:
        """``pid``, :meth:`ReplicaServer.stats` and the engine's own state
        (:meth:`~serve_app.server.engine_protocol.Engine.engine_state`; tests and
        debugging)."""
        return {"pid": os.getpid(), **self.server.stats(), **self.engine.engine_state()}

    async def drill(self, name: str, **kw: Any) -> Any:
        """Run the engine's drill ``name`` with ``kw`` (:func:`~serve_app.server.drills.run_drill`;
        tests and drills); returns what it returns.

        Raises:
            ValueError: the engine has no drill ``name`` (the message lists those it has).
        """
        logger.warning("variant %s: drill %s %s", self.server.variant, name, kw or "")
        return await run_drill(self.engine, name, **kw)

    async def kill_engine(self) -> None:
        """``drill("kill_engine")``: kill this replica's engine as a crash would; Serve then
        replaces the replica when its health check fails."""
        await self.drill("kill_engine")

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook (polled every ``request_routing_stats_period_s``): the
        adapters resident here, when (``time.time()``, s), and the engine's ``max_loras``
        (adapters one batch can mix; 0: LoRA off) and ``max_num_seqs``, for the replica
        router."""
        self._adapter_metrics.refresh()
        return {"adapters": self.server.adapters.resident_names(), "at": time.time(),
                "max_loras": self.engine.max_loras, "max_num_seqs": self.engine.max_num_seqs}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (pushed every ``metrics_interval_s``):
        :meth:`ReplicaServer.autoscaling_stats`, read by the resident-budget policy
        (:mod:`serve_app.control.resident_policy`); other policies ignore them."""
        return self.server.autoscaling_stats()

    async def evict(self, for_s: float = 60.0) -> None:
        """:meth:`ReplicaServer.evict`: the router's resident budget evicts this replica."""
        self.server.evict(for_s)

    async def serving_info(self) -> ReplicaInfo:
        """What the router's availability poll reads (:class:`ReplicaInfo`)."""
        return self.server.serving_info()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        """One request's answer stream (:meth:`ReplicaServer.generate`)."""
        async with aclosing(self.server.generate(request)) as answer:  # closed with ours
            async for item in answer:
                yield item

    def __del__(self):
        # Serve calls this after draining in-flight requests (graceful_shutdown_timeout_s).
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class AdapterMetrics:
    """The :class:`AdapterSet` ``on_event`` callback and the replica's adapter series:
    ``mesh_adapter_events`` (loaded, evicted, unloaded, refused, and per request hit or
    waited), ``mesh_adapter_load_seconds`` and the ``mesh_adapters_resident`` gauge.

    Ray drops a gauge value that is not set again within two export intervals, so
    :meth:`refresh` sets it again (from Serve's routing-stats poll)."""

    def __init__(self, variant: str, replica: str, adapters: AdapterSet) -> None:
        self.variant, self.replica, self.adapters = variant, replica, adapters
        self.events = Counter("mesh_adapter_events", "Adapter events: loaded, evicted, "
                              "unloaded, refused, hit (a request found it resident), waited "
                              "(it had to load).", tag_keys=("variant", "adapter", "event"))
        self.load_s = Histogram("mesh_adapter_load_seconds", "Time to make an adapter "
                                "resident, s.", boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
                                tag_keys=("variant",))
        self.resident = Gauge("mesh_adapters_resident", "Adapters loaded on a replica.",
                              tag_keys=("variant", "replica"))

    def __call__(self, key: str, event: str, seconds: float | None) -> None:
        self.events.inc(1, {"variant": self.variant, "adapter": key, "event": event})
        if event == "loaded":
            self.load_s.observe(seconds or 0.0, {"variant": self.variant})
        self.refresh()

    def refresh(self) -> None:
        self.resident.set(len(self.adapters.resident),
                          {"variant": self.variant, "replica": self.replica})


def build_app(args: dict[str, Any]) -> serve.Application:
    """``import_path: serve_app.replica:build_app``. Checks ``args`` with our schema, then
    with vLLM's own engine-config checks, before any replica is touched: a bad value fails
    the deploy (``DEPLOY_FAILED``, vLLM's message) and the running replicas keep serving.
    ``args`` vLLM accepted before, with the same vLLM and model files, are not checked again
    (:mod:`serve_app.server.engine_checks`: the check costs 10-20 s per build). A variant on
    the simulated engine (tests, benchmarks), or whose model from the hub or a bucket is not
    fetched on this node yet, is not checked here: its replica builds the same ``VllmConfig``
    when it starts, so a bad value fails its start instead. The deployment options are
    :func:`~serve_app.common.deployment_options.replica_options` of ``args`` (a placement
    group of one bundle per GPU for a replica that spans GPUs).

    Raises:
        ValueError: invalid ``args`` or engine arguments (the message names the field).
    """
    checked = VariantArgs.model_validate(args)
    fetched_later = (parse_source(checked.model, checked.revision).remote
                     and cached_model(checked.model, checked.revision) is None)
    if checked.engine == "vllm" and not fetched_later and not accepted_before(checked):
        try:
            engine_config(checked)
        except ValueError as e:
            raise ValueError(f"invalid engine_args for model {checked.model!r}: {e}") from None
        remember_accepted(checked)
    replica = serve.deployment(LLMReplica, **replica_options(checked)).bind(args)
    # LLMReplica behind an ingress of its own: see serve_app.variant_ingress for why.
    return serve.deployment(VariantIngress, **options(INGRESS_OPTIONS)).bind(replica)
