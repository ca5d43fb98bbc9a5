"""``MeshRouter``: the OpenAI-compatible ingress of application ``mesh``.

Per request: authenticate the tenant, parse and check the body, resolve the ``model`` field
to a route, pick a variant by weight (sticky per caller, see :mod:`serve_app.split`), call
that variant's ``LLMReplica`` through a ``DeploymentHandle``, and relay its answer. When a
variant fails before its first byte, the next one in
:func:`serve_app.ingress.split.failover_order` is tried (variants with a running replica first, see
:mod:`serve_app.availability`); when none can serve, 503 with ``Retry-After``.

Routes and weights come from the deployment's ``user_config`` (:class:`RouterConfig`) and are
applied in place by ``reconfigure()``; an invalid config is logged and ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve

from serve_app.common.adapters import adapter_name
from serve_app.ingress.admission import Rejected, Slot, VariantAdmission
from serve_app.ingress.availability import VariantAvailability
from serve_app.common.config import (RouterConfig, Split, Tenant, format_validation_error,
                              reject_user_config)
from serve_app.common.errors import MeshError, error_body
from serve_app.common.failures import Failure, handle_failure, nested_too_deeply
from serve_app.observability.metrics import MeshMetrics
from serve_app.ingress.split import failover_order, pick_variant
from serve_app.ingress.limits import TenantLimiter
from serve_app.ingress.relay import RelayResponse
from serve_app.release.rollout import Observation
from serve_app.release.rollout_controller import REPORT_PERIOD_S, RolloutController
from serve_app.ingress.tenancy import authenticate
from serve_app.common.wire import Head, Tail, Usage

logger = logging.getLogger("ray.serve")

#: Largest request body accepted, bytes (413 above it).
MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: Seconds a client should wait before retrying a 503.
RETRY_AFTER_S = 5
VARIANT_HEADER = "x-mesh-variant"
SESSION_HEADER = "x-session-id"
#: Seconds a config apply waits for the rollout controller before leaving it to the loop.
CONTROLLER_TIMEOUT_S = 10
#: Observations kept for the rollout controller while it cannot be reached; newer ones are
#: dropped above this (the controller judges on counts, so losing some only slows a verdict).
MAX_PENDING_OBSERVATIONS = 10_000

app = FastAPI(title="model mesh", description="OpenAI-compatible router over vLLM variants")


@app.exception_handler(MeshError)
async def _mesh_error(_: Request, exc: MeshError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected router error")
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


def _check_body_size(size: int) -> None:
    if size > MAX_REQUEST_BYTES:
        raise MeshError(413, f"request body is {size} bytes; the limit is {MAX_REQUEST_BYTES} "
                        "bytes", code="request_too_large")


async def read_json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object.

    Raises:
        MeshError: 415 not ``application/json``; 413 over :data:`MAX_REQUEST_BYTES`;
            400 malformed JSON or not an object.
    """
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise MeshError(415, f"Content-Type must be application/json, got {content_type!r}",
                        code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit():  # refuse before reading a body that is too large
        _check_body_size(int(declared))
    raw = await request.body()
    _check_body_size(len(raw))
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MeshError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise MeshError.of(nested_too_deeply()) from None
    if not isinstance(body, dict):
        raise MeshError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def caller_identity(request: Request, body: dict[str, Any], tenant: Tenant | None) -> str | None:
    """The identity that keeps a caller on one variant, most specific first:
    ``x-session-id`` header, then the OpenAI ``user`` field, then the tenant id."""
    return (request.headers.get(SESSION_HEADER) or _str_or_none(body.get("user"))
            or (tenant.id if tenant else None))


@serve.deployment(
    name="MeshRouter",
    graceful_shutdown_timeout_s=300,
    max_ongoing_requests=512,
    ray_actor_options={"num_cpus": 0.25},
)
@serve.ingress(app)
class MeshRouter:
    """OpenAI-compatible ingress that splits each route's traffic across variant apps.

    Args:
        controller: handle to the ``RolloutController`` deployment (progressive rollouts).
    """

    async def __init__(self, controller) -> None:
        self.config: RouterConfig | None = None
        self.splits: dict[str, Split] = {}
        self._tenants: dict[str, Tenant] = {}  # API key digest -> tenant
        self._handles: dict[str, Any] = {}
        self.metrics = MeshMetrics()
        self.limiter = TenantLimiter()
        self._admission: dict[str, VariantAdmission] = {}  # variant -> its slots and queue
        self.availability = VariantAvailability(self._handle, on_refresh=self._update_slots)
        self.controller = controller
        self._rollout_weights: dict[str, dict[str, int]] = {}  # split key -> arm -> weight
        self._observations: list[Observation] = []
        self._rollouts_synced = True
        await self.availability.start()
        self._rollout_task = asyncio.get_running_loop().create_task(self._rollout_loop())

    # -- configuration ------------------------------------------------------------------------

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Validate and apply a new ``user_config`` (:class:`RouterConfig`).

        An invalid config is logged with the path of each bad field and changes nothing;
        a router replica with no previous config raises instead. Rollout policies are sent
        to the ``RolloutController`` (see :mod:`serve_app.rollout_controller`).

        Raises:
            ValueError: invalid config and no last good one to keep.
        """
        try:
            new = RouterConfig.model_validate(user_config or {})
        except ValidationError as e:
            reject_user_config(self.config, "invalid MeshRouter user_config:\n"
                               + format_validation_error(e, "user_config"))
            self.metrics.config_rejected.inc()
            return
        self.config = new
        self.splits = new.splits()
        self._tenants = new.tenant_by_key_digest()
        self._update_slots()
        if not new.tenants:
            logger.warning("OPEN MODE: no tenants configured, every caller is anonymous and "
                           "unauthenticated. Add `tenants:` to the MeshRouter user_config "
                           "before exposing the mesh.")
        self._rollouts_synced = False
        try:
            await asyncio.wait_for(self._sync_rollouts(), CONTROLLER_TIMEOUT_S)
        except Exception as e:  # the loop retries; meanwhile rollouts hold their stable arm
            logger.warning("rollout controller not reached (%s: %s); retrying in the "
                           "background", type(e).__name__, e)
        logger.info("router config applied: %s", self.weights())

    def _require_config(self) -> RouterConfig:
        if self.config is None:
            raise MeshError(503, "the router has no routes configured yet; deploy a config "
                            "with MeshRouter user_config.routes", headers=_retry_after())
        return self.config

    def _update_slots(self) -> None:
        """Apply each route's admission settings and each variant's slots (from the
        availability view) to the variants' admission queues."""
        if self.config is None:
            return
        for rc in self.config.routes.values():
            for v in rc.variants:
                queue = self._admission.get(v.application)
                if queue is None:
                    queue = self._admission[v.application] = VariantAdmission(v.application)
                queue.configure(**rc.admission.model_dump())
                queue.set_capacity(self.availability.slots(v.application))

    def _handle(self, application: str):
        handle = self._handles.get(application)
        if handle is None:
            handle = serve.get_deployment_handle("LLMReplica", app_name=application)
            self._handles[application] = handle
        return handle

    # -- progressive rollouts -----------------------------------------------------------------

    async def _sync_rollouts(self) -> None:
        specs = {key: {"stable": split.weighted[0][0], "canary": split.weighted[-1][0],
                       "policy": split.rollout.model_dump()}
                 for key, split in self.splits.items() if split.rollout}
        self._rollout_weights = await self.controller.sync.remote(specs)
        self._rollouts_synced = True

    async def _rollout_loop(self) -> None:
        """Every REPORT_PERIOD_S: send observations, read the rollouts' weights back."""
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            try:
                if not self._rollouts_synced:
                    await self._sync_rollouts()
                if any(split.rollout for split in self.splits.values()):
                    batch, self._observations = self._observations, []
                    self._rollout_weights = await self.controller.report.remote(batch)
            except Exception as e:  # keep the last weights; the controller may be restarting
                logger.warning("rollout controller: %s: %s", type(e).__name__, str(e)[:300])

    def _weighted(self, key: str) -> list[tuple[str, int]]:
        """The arms of split ``key`` with the weights in force: the rollout's when it has
        one (its stable arm alone until the controller has answered), else the config's."""
        split = self.splits[key]
        if split.rollout is None:
            return split.weighted
        weights = self._rollout_weights.get(key) or {split.weighted[0][0]: 100}
        return [(arm, weights.get(arm, 0)) for arm, _ in split.weighted]

    def weights(self) -> dict[str, dict[str, int]]:
        """Split key -> arm -> weight in force (for logs and ``/health``)."""
        return {key: dict(self._weighted(key)) for key in self.splits}

    def _observe(self, arms: list[tuple[str, str]], *, error: bool, truncated: bool = False,
                 ttft_s: float | None = None, latency_s: float) -> None:
        """Queue an observation for each ``(split key, arm)`` under a rollout."""
        for key, arm in arms:
            if (self.splits.get(key) and self.splits[key].rollout
                    and len(self._observations) < MAX_PENDING_OBSERVATIONS):
                self._observations.append(Observation(key, arm, error, truncated, ttft_s,
                                                      latency_s))

    # -- endpoints ----------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        """Router liveness, the weights in force per route (and per adapter version split),
        and which variants have a running replica (as of the last poll of the Serve
        controller, at most ~1 s old)."""
        config = self._require_config()
        weights = self.weights()
        return {"status": "ok", "open_mode": not config.tenants,
                "routes": {k: w for k, w in weights.items() if k in config.routes},
                "adapters": {k: w for k, w in weights.items() if k not in config.routes},
                "available": {a: self.availability.is_available(a)
                              for a in sorted(config.applications())}}

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        """OpenAI ``GET /v1/models``: the routes the caller may use."""
        config = self._require_config()
        tenant = authenticate(self._tenants, request.headers.get("authorization"))
        ids = []
        for route, rc in config.routes.items():
            if tenant is not None and not tenant.may_call(route):
                continue
            ids.append(route)
            served = {adapter_name(key) for v in rc.variants
                      for key in self.availability.adapters.get(v.application, ())}
            ids += [f"{route}:{a}" for a in sorted(served)
                    if tenant is None or a in tenant.adapters]
        return {"object": "list", "data": [
            {"id": i, "object": "model", "created": 0, "owned_by": "model-mesh"} for i in ids]}

    def _require_admin(self, request: Request) -> RouterConfig:
        config = self._require_config()
        tenant = authenticate(self._tenants, request.headers.get("authorization"))
        if config.tenants and not (tenant and tenant.admin):
            raise MeshError(403, "/admin endpoints are for admin callers only",
                            code="admin_only")
        return config

    @app.get("/admin/adapters")
    async def adapter_status(self, request: Request) -> dict[str, Any]:
        """Admin: per variant, the adapters served, draining and refused (with reasons)."""
        apps = sorted(self._require_admin(request).applications())
        stats = await asyncio.gather(*(self._handle(a).stats.remote() for a in apps),
                                     return_exceptions=True)
        return {a: (s["adapters"] if isinstance(s, dict) else {"error": str(s)[:300]})
                for a, s in zip(apps, stats)}

    @app.get("/admin/rollouts")
    async def rollout_status(self, request: Request) -> dict[str, Any]:
        """Admin: every progressive rollout by split key: state, step, weights, policy and
        the decision history with the figures behind each decision."""
        self._require_admin(request)
        try:
            return await asyncio.wait_for(self.controller.snapshot.remote(),
                                          CONTROLLER_TIMEOUT_S)
        except Exception as e:
            raise MeshError(503, f"the rollout controller did not answer ({type(e).__name__}); "
                            "retry", code="controller_unavailable",
                            headers=_retry_after()) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """OpenAI ``POST /v1/chat/completions`` (``stream: true`` gives SSE)."""
        return await self._serve("chat", request)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        """OpenAI ``POST /v1/completions`` (``stream: true`` gives SSE)."""
        return await self._serve("completion", request)

    # -- request path -------------------------------------------------------------------------

    async def _serve(self, endpoint: str, request: Request) -> Response:
        t0 = time.monotonic()
        tags = {"route": "", "variant": "", "tenant": "", "adapter": ""}
        try:
            return await self._route(endpoint, request, tags, t0)
        except MeshError as e:
            # Rejections by the router itself (overloaded, queue_timeout, shed,
            # no_healthy_variant) are counted by their code; the rest by status.
            kind = e.code if e.status in (500, 503) and e.code else None
            self.metrics.record(tags, e.status, time.monotonic() - t0, error_kind=kind)
            raise

    async def _route(self, endpoint: str, request: Request, tags: dict[str, str], t0: float
                     ) -> Response:
        config = self._require_config()
        tenant = authenticate(self._tenants, request.headers.get("authorization"))
        tags["tenant"] = tenant.id if tenant else ""
        body = await read_json_body(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise MeshError(400, "you must provide a model parameter (a route name, e.g. "
                            f"{next(iter(config.routes))!r}, or route:adapter; see "
                            "GET /v1/models)", param="model")
        route_name, _, adapter = model.partition(":")
        if route_name not in config.routes or "@" in adapter:
            raise MeshError(404, f"The model {model!r} does not exist. See GET /v1/models for "
                            "the models you can use.", param="model", code="model_not_found")
        if tenant and not tenant.may_call(route_name):
            raise MeshError(403, f"tenant {tenant.id!r} may not call model {route_name!r}",
                            param="model", code="model_not_allowed")
        tags["route"], tags["adapter"] = route_name, adapter
        identity = caller_identity(request, body, tenant)
        priority = tenant.priority if tenant else 0
        if "priority" in body and body["priority"] != priority:
            raise MeshError(400, "the request field `priority` is set by the mesh from your "
                            f"tenant's config (yours is {priority}); remove it from the "
                            "request", param="priority", code="priority_not_allowed")

        weighted = self._weighted(route_name)
        version = None  # adapter version chosen by an adapter split ("name@vN")
        if adapter:
            self._check_adapter_owner(adapter, tenant)
            version = await self._pick_adapter_version(route_name, adapter, identity)
            weighted = await self._variants_with_adapter(weighted, model, version or adapter)
        pinned = request.headers.get(VARIANT_HEADER)
        if pinned:
            if tenant is None or not tenant.admin:
                raise MeshError(403, f"the {VARIANT_HEADER} request header (pinning a variant) "
                                "is for admin callers only", code="pinning_not_allowed")
            if pinned not in dict(weighted):
                raise MeshError(400, f"variant {pinned!r} is not a variant of route {model!r} "
                                f"(variants: {', '.join(dict(weighted))})",
                                code="unknown_variant")
            candidates = [pinned]
        else:
            first = pick_variant(weighted, self.splits[route_name].salt, identity)
            candidates = self.availability.prefer_available(failover_order(weighted, first))

        # Rollouts judge only traffic the split chose (not pinned requests).
        arms = [] if pinned else [(route_name, "")]
        if version:
            arms.append((f"{route_name}:{adapter}", version))
        self.limiter.acquire(tenant)
        try:
            response = await self._call_variants(
                endpoint, body, candidates, version, arms, tags, t0, tenant,
                (priority, priority <= config.top_priority()))
        except BaseException:
            self.limiter.release(tenant)
            raise
        if not isinstance(response, RelayResponse):  # it releases the slot itself
            self.limiter.release(tenant)
        return response

    def _check_adapter_owner(self, adapter: str, tenant: Tenant | None) -> None:
        """Raises MeshError 403 when ``adapter`` belongs to another tenant (or to none, and
        the caller does not own it)."""
        if tenant is not None and adapter not in tenant.adapters:
            if any(adapter in t.adapters for t in self._tenants.values()) or any(
                    self.availability.serves(v, adapter) for v in self.availability.adapters):
                raise MeshError(403, f"tenant {tenant.id!r} may not use adapter {adapter!r}",
                                param="model", code="adapter_not_allowed")

    async def _pick_adapter_version(self, route: str, adapter: str, identity: str | None
                                    ) -> str | None:
        """The version ``name@vN`` an adapter split gives this caller (sticky); if no variant
        of the route serves that version (yet), the next one that is served, in failover
        order. None when the adapter has no split or no version is served (the variant then
        uses its default version)."""
        key = f"{route}:{adapter}"
        if key not in self.splits:
            return None
        variants = [a for a, _ in self.splits[route].weighted]

        def served(version: str) -> bool:
            return any(self.availability.serves(a, version) for a in variants)

        weighted = self._weighted(key)
        chosen = pick_variant(weighted, self.splits[key].salt, identity)
        if not served(chosen):  # a deploy may have just added it: look again first
            await self.availability.refresh()
        return next((v for v in failover_order(weighted, chosen) if served(v)), None)

    async def _variants_with_adapter(self, weighted: list[tuple[str, int]], model: str,
                                     adapter: str) -> list[tuple[str, int]]:
        """The route's variants that serve ``adapter`` (a name, or a version ``name@vN``).

        Raises:
            MeshError: 404 no variant serves it.
        """
        def serving() -> list[tuple[str, int]]:
            return [(v, w) for v, w in weighted if self.availability.serves(v, adapter)]

        found = serving()
        if not found:  # a deploy may have just added it: look again before saying 404
            await self.availability.refresh()
            found = serving()
        if not found:
            raise MeshError(404, f"The model {model!r} does not exist: no variant of the route "
                            f"serves adapter {adapter!r}. See GET /v1/models.", param="model",
                            code="model_not_found")
        if sum(w for _, w in found) == 0:  # only weight-0 variants have it: split evenly
            found = [(v, 1) for v, _ in found]
        return found

    async def _call_variants(self, endpoint: str, body: dict[str, Any], candidates: list[str],
                             version: str | None, arms: list[tuple[str, str]],
                             tags: dict[str, str], t0: float, tenant: Tenant | None,
                             priority: tuple[int, bool]) -> Response:
        """Try ``candidates`` in order until one answers; relay its answer.

        Only variant failures (:class:`serve_app.common.failures.Failure`) move on to the next
        candidate; a request error or an internal error is this request's answer.
        ``arms``: the ``(split key, arm)`` pairs the request went through; the route's arm is
        filled in with the variant that answers. ``priority``: the tenant's priority and
        whether it is the best configured (admission order, reserved slots)."""
        model = tags["route"]
        stream_requested = bool(body.get("stream"))
        queue_timeout_s = self.config.routes[model].admission.queue_timeout_s
        if all(self.availability.slots(c) == 0 for c in candidates):
            await self.availability.refresh(max_age_s=0.5)  # one may have just started
        for variant in candidates:
            admission = self._admission.get(variant) or VariantAdmission(variant)
            try:
                slot = await admission.acquire(*priority)
            except Rejected as r:
                if r.reason == "unavailable":  # no running replica: the next candidate
                    continue
                tags["variant"] = variant
                raise MeshError(503, r.message, code=r.reason,
                                headers={"Retry-After": str(r.retry_after_s)}) from None
            tags["variant"] = variant
            here = [(key, arm or variant) for key, arm in arms]
            stream = self._handle(variant).options(stream=True).generate.remote(
                endpoint, body, version, priority[0])
            try:
                # A stream's head comes as soon as vLLM has checked the request; waiting
                # longer means the replica cannot take it (a non-stream's head is its whole
                # answer, so only the client's timeout applies).
                head: Head = await (asyncio.wait_for(stream.__anext__(), queue_timeout_s)
                                    if stream_requested else stream.__anext__())
            except BaseException as e:
                admission.release(slot)
                stream.cancel()
                if not isinstance(e, Exception):  # the client left (CancelledError)
                    raise
                failure = handle_failure(e)
                if failure is Failure.REQUEST:
                    raise MeshError.of(nested_too_deeply()) from None
                if failure is Failure.INTERNAL:
                    logger.error("variant %s: internal error: %s: %s", variant,
                                 type(e).__name__, str(e)[:2000])
                    raise MeshError(500, f"internal error in variant {variant}: "
                                    f"{type(e).__name__}", code="internal_error") from None
                self._failed_over(model, variant, here, t0, f"{type(e).__name__}: {str(e)[:500]}")
                continue
            if head.failure is Failure.VARIANT:
                admission.release(slot)
                self._failed_over(model, variant, here, t0, (head.body or "")[:500])
                continue
            headers = {VARIANT_HEADER: variant, **head.headers}
            if head.stream:
                return RelayResponse(stream, variant, t0, self._finisher(
                    dict(tags), here, t0, tenant, admission, slot), headers)
            admission.release(slot)
            usage = head.usage or Usage()
            latency = time.monotonic() - t0
            self.metrics.record(tags, head.status, latency, prompt_tokens=usage.prompt_tokens,
                                completion_tokens=usage.completion_tokens,
                                error_kind="internal_error"
                                if head.failure is Failure.INTERNAL else None)
            if head.failure is None:  # a request's or our own error says nothing of the arm
                self._observe(here, error=False, latency_s=latency)
            return Response(head.body, status_code=head.status, media_type="application/json",
                            headers=headers)
        tags["variant"] = ""
        raise MeshError(503, f"no variant of route {model!r} can take the request now "
                        f"(tried {', '.join(candidates)})", code="no_healthy_variant",
                        headers=_retry_after())

    def _failed_over(self, route: str, variant: str, arms: list[tuple[str, str]], t0: float,
                     why: str) -> None:
        """A variant failed before its first byte: count it, tell the rollout, move on."""
        logger.warning("variant %s failed before the first byte (%s); failing over", variant,
                       why)
        self.metrics.failovers.inc(1, {"route": route, "variant": variant})
        self._observe(arms, error=True, latency_s=time.monotonic() - t0)

    def _finisher(self, tags: dict[str, str], arms: list[tuple[str, str]], t0: float,
                  tenant: Tenant | None, admission: VariantAdmission, slot: Slot):
        """What runs when a relayed stream ends: release the tenant's and the variant's
        slots, record metrics and the rollout observation."""
        def finish(ttft_s: float | None, tail: Tail, error_kind: str | None) -> None:
            self.limiter.release(tenant)
            admission.release(slot)
            latency = time.monotonic() - t0
            usage = tail.usage
            self.metrics.record(tags, 200, latency, ttft_s=ttft_s,
                                prompt_tokens=usage.prompt_tokens,
                                completion_tokens=usage.completion_tokens, error_kind=error_kind)
            if error_kind in (None, "stream_failed"):  # only variant failures count
                truncated = error_kind == "stream_failed"
                self._observe(arms, error=truncated, truncated=truncated, ttft_s=ttft_s,
                              latency_s=latency)
        return finish


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve application builder: ``import_path: serve_app.router:build_app``.

    Module-level helpers used by ``MeshRouter`` sit above the class: ``serve.ingress``
    pickles the class by value with the globals it sees at that point.
    """
    return MeshRouter.bind(RolloutController.bind())
