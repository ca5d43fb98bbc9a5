"""``MeshRouter``: the OpenAI-compatible ingress of application ``mesh``.

Per request: authenticate the tenant, parse and check the body, resolve the ``model`` field
to a route, pick a variant by weight (sticky per caller, see :mod:`serve_app.split`), call
that variant's ``LLMReplica`` through a ``DeploymentHandle``, and relay its answer. When a
variant fails before its first byte, the next one in
:func:`serve_app.split.failover_order` is tried (variants with a running replica first, see
:mod:`serve_app.availability`); when none can serve, 503 with ``Retry-After``.

Routes and weights come from the deployment's ``user_config`` (:class:`RouterConfig`) and are
applied in place by ``reconfigure()``; an invalid config is logged and ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from serve_app.availability import VariantAvailability
from serve_app.config import RouterConfig, Tenant, format_validation_error, reject_user_config
from serve_app.errors import MeshError, error_body
from serve_app.metrics import MeshMetrics
from serve_app.split import failover_order, pick_variant
from serve_app.limits import TenantLimiter
from serve_app.tenancy import authenticate
from serve_app.wire import Head, Usage

logger = logging.getLogger("ray.serve")

#: Largest request body accepted, bytes (413 above it).
MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: Seconds a client should wait before retrying a 503.
RETRY_AFTER_S = 5
VARIANT_HEADER = "x-mesh-variant"
SESSION_HEADER = "x-session-id"

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


async def _relay(stream, tags: dict[str, str], metrics: MeshMetrics, t0: float,
                 on_end) -> AsyncIterator[str]:
    """Pass SSE lines through and account for the request when it ends.

    A failure mid-stream ends it with an SSE error event (the status is already sent)."""
    ttft = None
    usage = Usage()
    error_kind = None
    try:
        async for item in stream:
            if isinstance(item, Usage):
                usage = item
                continue
            if ttft is None:
                ttft = time.monotonic() - t0
            yield item
    except asyncio.CancelledError:
        error_kind = "client_disconnected"
        raise
    except Exception as e:
        error_kind = "stream_failed"
        logger.error("variant %s failed mid-stream: %s: %s", tags["variant"], type(e).__name__, e)
        message = f"variant {tags['variant']} failed mid-stream; retry the request"
        yield f"data: {json.dumps(error_body(503, message))}\n\n"
    finally:
        on_end()
        metrics.record(tags, 200, time.monotonic() - t0, ttft_s=ttft,
                       prompt_tokens=usage.prompt_tokens,
                       completion_tokens=usage.completion_tokens, error_kind=error_kind)


@serve.deployment(
    name="MeshRouter",
    graceful_shutdown_timeout_s=300,
    max_ongoing_requests=512,
    ray_actor_options={"num_cpus": 0.25},
)
@serve.ingress(app)
class MeshRouter:
    """OpenAI-compatible ingress that splits each route's traffic across variant apps."""

    async def __init__(self) -> None:
        self.config: RouterConfig | None = None
        self._tenants: dict[str, Tenant] = {}  # API key digest -> tenant
        self._handles: dict[str, Any] = {}
        self.metrics = MeshMetrics()
        self.limiter = TenantLimiter()
        self.availability = VariantAvailability(self._handle)
        await self.availability.start()

    # -- configuration ------------------------------------------------------------------------

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Validate and apply a new ``user_config`` (:class:`RouterConfig`).

        An invalid config is logged with the path of each bad field and changes nothing;
        a router replica with no previous config raises instead.

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
        self._tenants = new.tenant_by_key_digest()
        if not new.tenants:
            logger.warning("OPEN MODE: no tenants configured, every caller is anonymous and "
                           "unauthenticated. Add `tenants:` to the MeshRouter user_config "
                           "before exposing the mesh.")
        logger.info("router config applied: %s", new.weights())

    def _require_config(self) -> RouterConfig:
        if self.config is None:
            raise MeshError(503, "the router has no routes configured yet; deploy a config "
                            "with MeshRouter user_config.routes", headers=_retry_after())
        return self.config

    def _handle(self, application: str):
        handle = self._handles.get(application)
        if handle is None:
            handle = serve.get_deployment_handle("LLMReplica", app_name=application)
            self._handles[application] = handle
        return handle

    # -- endpoints ----------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        """Router liveness, the routes with their weights, and which variants have a running
        replica (as of the last poll of the Serve controller, at most ~1 s old)."""
        config = self._require_config()
        return {"status": "ok", "open_mode": not config.tenants, "routes": config.weights(),
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
            served = set().union(*(self.availability.adapters.get(v.application, set())
                                   for v in rc.variants))
            ids += [f"{route}:{a}" for a in sorted(served)
                    if tenant is None or a in tenant.adapters]
        return {"object": "list", "data": [
            {"id": i, "object": "model", "created": 0, "owned_by": "model-mesh"} for i in ids]}

    @app.get("/admin/adapters")
    async def adapter_status(self, request: Request) -> dict[str, Any]:
        """Admin: per variant, the adapters served, draining and refused (with reasons)."""
        config = self._require_config()
        tenant = authenticate(self._tenants, request.headers.get("authorization"))
        if config.tenants and not (tenant and tenant.admin):
            raise MeshError(403, "/admin endpoints are for admin callers only",
                            code="admin_only")
        apps = sorted(config.applications())
        stats = await asyncio.gather(*(self._handle(a).stats.remote() for a in apps),
                                     return_exceptions=True)
        return {a: (s["adapters"] if isinstance(s, dict) else {"error": str(s)[:300]})
                for a, s in zip(apps, stats)}

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
            self.metrics.record(tags, e.status, time.monotonic() - t0)
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
        route = config.routes.get(route_name)
        if route is None:
            raise MeshError(404, f"The model {model!r} does not exist. See GET /v1/models for "
                            "the models you can use.", param="model", code="model_not_found")
        if tenant and not tenant.may_call(route_name):
            raise MeshError(403, f"tenant {tenant.id!r} may not call model {route_name!r}",
                            param="model", code="model_not_allowed")
        tags["route"], tags["adapter"] = route_name, adapter

        weighted = [(w.application, w.weight) for w in route.variants]
        if adapter:
            weighted = await self._variants_with_adapter(weighted, model, adapter, tenant)
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
            first = pick_variant(weighted, route.salt or route_name,
                                 caller_identity(request, body, tenant))
            candidates = self.availability.prefer_available(failover_order(weighted, first))

        self.limiter.acquire(tenant)
        try:
            response = await self._call_variants(endpoint, body, candidates, tags, t0, tenant)
        except BaseException:
            self.limiter.release(tenant)
            raise
        if not isinstance(response, StreamingResponse):
            self.limiter.release(tenant)
        return response

    async def _variants_with_adapter(self, weighted: list[tuple[str, int]], model: str,
                                     adapter: str, tenant: Tenant | None
                                     ) -> list[tuple[str, int]]:
        """The route's variants that serve ``adapter``, after the tenant's ownership check.

        Raises:
            MeshError: 403 the adapter belongs to another tenant; 404 no variant serves it.
        """
        def serving() -> list[tuple[str, int]]:
            return [(v, w) for v, w in weighted if adapter in self.availability.adapters.get(v, ())]

        found = serving()
        if not found:  # a deploy may have just added it: look again before saying 404
            await self.availability.refresh()
            found = serving()
        if tenant is not None and adapter not in tenant.adapters:
            if found or any(adapter in t.adapters for t in self._tenants.values()):
                raise MeshError(403, f"tenant {tenant.id!r} may not use adapter {adapter!r}",
                                param="model", code="adapter_not_allowed")
        if not found:
            raise MeshError(404, f"The model {model!r} does not exist: no variant of the route "
                            f"serves adapter {adapter!r}. See GET /v1/models.", param="model",
                            code="model_not_found")
        if sum(w for _, w in found) == 0:  # only weight-0 variants have it: split evenly
            found = [(v, 1) for v, _ in found]
        return found

    async def _call_variants(self, endpoint: str, body: dict[str, Any], candidates: list[str],
                             tags: dict[str, str], t0: float, tenant: Tenant | None) -> Response:
        model = tags["route"]
        for variant in candidates:
            tags["variant"] = variant
            stream = self._handle(variant).options(stream=True).generate.remote(endpoint, body)
            try:
                head: Head = await stream.__anext__()
            except Exception as e:  # the variant could not take it: nothing sent yet, try next
                logger.warning("variant %s failed before the first byte (%s: %s); failing over",
                               variant, type(e).__name__, str(e)[:500])
                self.metrics.failovers.inc(1, {"route": model, "variant": variant})
                continue
            headers = {VARIANT_HEADER: variant, **head.headers}
            if head.stream:
                return StreamingResponse(
                    _relay(stream, dict(tags), self.metrics, t0,
                           on_end=lambda: self.limiter.release(tenant)),
                    media_type="text/event-stream", headers=headers)
            usage = head.usage or Usage()
            self.metrics.record(tags, head.status, time.monotonic() - t0,
                                prompt_tokens=usage.prompt_tokens,
                                completion_tokens=usage.completion_tokens)
            return Response(head.body, status_code=head.status, media_type="application/json",
                            headers=headers)
        tags["variant"] = ""
        raise MeshError(503, f"no variant of route {model!r} can take the request now "
                        f"(tried {', '.join(candidates)})", code="no_healthy_variant",
                        headers=_retry_after())


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve application builder: ``import_path: serve_app.router:build_app``.

    Module-level helpers used by ``MeshRouter`` sit above the class: ``serve.ingress``
    pickles the class by value with the globals it sees at that point.
    """
    return MeshRouter.bind()
