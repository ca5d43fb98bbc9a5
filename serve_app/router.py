"""``MeshRouter``: the OpenAI-compatible ingress of application ``mesh`` (HTTP only).

A request goes one way through the stages, each a package of its own:

1. authenticate: the tenant from its API key (:mod:`serve_app.tenancy.keys`);
2. plan: read the body and decide route, adapter version and variants in order
   (:mod:`serve_app.request`);
3. limits: take the tenant's slot and reserve its tokens (:mod:`serve_app.tenancy.limits`);
4. admit: a slot of the variant's admission queue (:mod:`serve_app.admission`);
5. call: the variant's replica through its handle, failover before the first byte
   (:mod:`serve_app.dispatch.dispatcher`);
6. relay: the stream to the client (:mod:`serve_app.dispatch.relay`).

One :class:`~serve_app.dispatch.account.RequestAccount` per request owns its slots, metrics
and rollout observation, and releases them once however the request ends. The variants
themselves (handles, admission queues, availability, cold starts, resident budget) are one
:class:`~serve_app.variants.registry.VariantRegistry`.

Routes, weights and tenants come from the deployment's ``user_config``
(:class:`~serve_app.common.config.RouterConfig`), applied in place by ``reconfigure()``; an
invalid config is logged and ignored.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve

from serve_app.common.logs import get_logger
from serve_app.common.config import RouterConfig
from serve_app.common.deployment_options import CONTROLLER_OPTIONS, ROUTER_OPTIONS, options
from serve_app.common.failures import RETRY_AFTER_S
from serve_app.common.errors import (MeshError, error_body, format_validation_error,
                                     reject_user_config)
from serve_app.dispatch.account import REQUEST_ID_HEADER, RequestAccount, request_id_for
from serve_app.dispatch.dispatcher import Dispatcher
from serve_app.tenancy.ledger import ledger_for
from serve_app.tenancy.limits import TenantLimiter
from serve_app.request.planner import SESSION_HEADER, VARIANT_HEADER, RequestPlanner
from serve_app.request.body import read_json_body
from serve_app.control.rollout_client import RolloutClient
from serve_app.control.shadow_mirror import ShadowMirror, effective_shadow
from serve_app.request.split import splits_of
from serve_app.tenancy.keys import authenticate
from serve_app.tenancy.token_budget import Reservation
from serve_app.observability.metrics import MeshMetrics
from serve_app.control.rollout_controller import RolloutController
from serve_app.variants.registry import VariantRegistry

logger = get_logger(__name__)

#: Seconds a config apply or an admin call waits for the rollout controller.
CONTROLLER_TIMEOUT_S = 10

app = FastAPI(title="model mesh", description="OpenAI-compatible router over vLLM variants")


@app.exception_handler(MeshError)
async def _mesh_error(_: Request, exc: MeshError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected router error")
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


@serve.ingress(app)
class MeshRouter:
    """OpenAI-compatible ingress that splits each route's traffic across variant apps.

    Args:
        controller: handle to the ``RolloutController`` deployment (progressive rollouts).
    """

    async def __init__(self, controller) -> None:
        self.config: RouterConfig | None = None
        self.planner: RequestPlanner | None = None
        self._tenants = {}  # API key digest -> tenant
        self.metrics = MeshMetrics()
        self.variants = VariantRegistry(self.metrics)
        self.availability = self.variants.availability
        self.limiter = TenantLimiter(routers=lambda: self.availability.routers)
        self.rollouts = RolloutClient(controller)
        self.controller = controller
        self.dispatcher = Dispatcher(self.variants)
        self.shadows = ShadowMirror(self.variants, self.metrics, self.rollouts.observe_shadow)
        await self.availability.start()
        self.rollouts.start()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Validate and apply a new ``user_config`` (:class:`RouterConfig`).

        An invalid config is logged with the path of each bad field and changes nothing;
        a router replica with no previous config raises instead. Rollout policies are sent
        to the ``RolloutController``.

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
        splits = splits_of(new)
        ledger_changed = self.config is None or self.config.ledger != new.ledger
        self.config = new
        self._tenants = new.tenant_by_key_digest()
        self.planner = RequestPlanner(new, splits, self.rollouts.weighted, self.availability)
        self.variants.configure(new)
        if ledger_changed:  # counted there from the next request; ready before it comes
            self.limiter.use(lambda: ledger_for(new.ledger), leases=new.ledger.leases)
            await self.limiter.start()
        if not new.tenants:
            logger.warning("OPEN MODE: no tenants configured, every caller is anonymous and "
                           "unauthenticated. Add `tenants:` to the MeshRouter user_config "
                           "before exposing the mesh.")
        try:
            await asyncio.wait_for(self.rollouts.apply(splits), CONTROLLER_TIMEOUT_S)
        except Exception as e:  # the loop retries; meanwhile rollouts hold their stable arm
            logger.warning("rollout controller not reached (%s: %s); retrying in the "
                           "background", type(e).__name__, e)
        logger.info("router config applied: %s", self.rollouts.weights())

    def _require_config(self) -> RouterConfig:
        if self.config is None:
            raise MeshError(503, "the router has no routes configured yet; deploy a config "
                            "with MeshRouter user_config.routes",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        return self.config

    def _require_admin(self, request: Request) -> RouterConfig:
        """The config, for an admin caller. Open mode has no admin: every caller is
        anonymous, so ``/admin/*`` (kept shadow prompts included) answers no one.

        Raises:
            MeshError: 503 no config yet; 401 a missing or unknown key; 403 ``admin_only``
                for a tenant that is not admin, or in open mode.
        """
        config = self._require_config()
        if not config.tenants:
            raise MeshError(403, "/admin endpoints need an admin caller, and this mesh runs "
                            "in open mode (no tenants, everyone anonymous): add `tenants:` "
                            "with an admin tenant (`admin: true`) to the MeshRouter "
                            "user_config and call with its key", code="admin_only")
        tenant = authenticate(self._tenants, request.headers.get("authorization"))
        if not (tenant and tenant.admin):
            raise MeshError(403, "/admin endpoints are for admin callers only",
                            code="admin_only")
        return config

    def _sees_everything(self, request: Request, config: RouterConfig) -> bool:
        """Open mode (no tenant's names to keep apart: ``GET /v1/models`` lists every
        adapter to anyone), or an admin tenant's key; never raises (``/health`` is a probe)."""
        if not config.tenants:
            return True
        try:
            tenant = authenticate(self._tenants, request.headers.get("authorization"))
        except MeshError:
            return False
        return bool(tenant and tenant.admin)

    # -- endpoints ----------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """OpenAI ``POST /v1/chat/completions`` (``stream: true`` gives SSE)."""
        return await self._serve("chat", request)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        """OpenAI ``POST /v1/completions`` (``stream: true`` gives SSE)."""
        return await self._serve("completion", request)

    async def _serve(self, endpoint: str, request: Request) -> Response:
        self._require_config()
        planner = self.planner
        request_id = request_id_for(request.headers.get(REQUEST_ID_HEADER))
        account = RequestAccount(self.metrics, self.rollouts.observe, planner.labels(None, None),
                                 request_id)
        quota_headers: dict[str, str] = {}
        try:
            tenant = authenticate(self._tenants, request.headers.get("authorization"))
            account.tags = planner.labels(tenant, None)
            body = await read_json_body(request)
            account.tags = planner.labels(tenant, body)
            plan = await planner.plan(endpoint, body, tenant, request_id=request_id,
                                      session_id=request.headers.get(SESSION_HEADER),
                                      pinned=request.headers.get(VARIANT_HEADER))
            account.tags, account.arms = plan.tags, plan.arms
            quota_headers = await account.hold_tenant_slot(
                self.limiter, tenant, Reservation.of(endpoint, body, self.variants.context_len(plan.candidates)))
            # From here on only the plan is read: a deploy during the await above may have
            # changed (or removed) the route in self.config.
            account.capture = self.shadows.maybe_mirror(plan, effective_shadow(
                plan.shadow, self.rollouts.shadow_phase(plan.route)), plan.identity, request_id)
            response = await self.dispatcher.dispatch(plan, account)
            response.headers.update(quota_headers)  # OpenAI's x-ratelimit-* headers
            return response
        except MeshError as e:
            # A limited tenant's refusal after its slot was taken (503 overloaded, ...) carries
            # its x-ratelimit-* headers too, as every answer to it does.
            e.headers = {**quota_headers, **e.headers}
            # The router's own refusals (overloaded, queue_timeout, shed, no_healthy_variant,
            # internal_error) are counted by their code; the rest by status.
            if e.status != 500:
                account.refused(e.status, e.code or f"http_{e.status}")
            account.finish(e.status, error_kind=e.code if e.status >= 500 and e.code else None)
            raise
        except asyncio.CancelledError:  # the client left (while queued, or waiting for a head)
            account.finish(499, error_kind="client_disconnected")
            raise
        except BaseException:
            account.finish(500, error_kind="internal_error")
            raise

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        """OpenAI ``GET /v1/models``: the routes (and ``route:adapter``) the caller may use."""
        self._require_config()
        tenant = authenticate(self._tenants, request.headers.get("authorization"))
        return {"object": "list", "data": [
            {"id": i, "object": "model", "created": 0, "owned_by": "model-mesh"}
            for i in self.planner.model_ids(tenant)]}

    @app.get("/health")
    async def health(self, request: Request) -> dict[str, Any]:
        """Router liveness: ``status``, ``open_mode`` and, per route, whether a variant of
        it can take a request now or be woken for one (``routes_available``). An admin
        caller (and any caller in open mode) also gets the weights in force per route and
        per adapter version split, which variants have a running replica (as of the last
        poll, at most ~1 s old), per variant that scales to zero its state (``warm``,
        ``starting``, ``zero``) and since when (epoch s), and with a resident budget the
        budget and the variants resident now (``resident_budget``, else null). Anyone else
        gets no adapter or variant name: adapter names are their tenants' own."""
        config = self._require_config()
        summary = {"status": "ok", "open_mode": not config.tenants, "routes_available": {
            route: any(self.availability.is_available(v.application)
                       or self.availability.is_asleep(v.application) for v in rc.variants)
            for route, rc in config.routes.items()}}
        if not self._sees_everything(request, config):
            return summary
        weights = self.rollouts.weights()
        return {**summary,
                "routes": {k: w for k, w in weights.items() if k in config.routes},
                "adapters": {k: w for k, w in weights.items() if k not in config.routes},
                "available": {a: self.availability.is_available(a)
                              for a in sorted(config.applications())},
                "scale_to_zero": self.availability.states(),
                "resident_budget": self.variants.budget.status()}

    @app.get("/admin/adapters")
    async def adapter_status(self, request: Request) -> dict[str, Any]:
        """Admin: per variant, the adapters served, draining and refused (with reasons). A
        variant at zero replicas is not woken for it: ``{"asleep": true}``."""
        apps = sorted(a for a in self._require_admin(request).applications()
                      if not self.availability.is_asleep(a))
        stats = await asyncio.gather(*(self.variants.handle(a).stats.remote() for a in apps),
                                     return_exceptions=True)
        return {**{a: {"asleep": True} for a in sorted(self.config.applications())
                   if self.availability.is_asleep(a)},
                **{a: (s["adapters"] if isinstance(s, dict) else {"error": str(s)[:300]})
                   for a, s in zip(apps, stats)}}

    @app.get("/admin/shadows")
    async def shadow_status(self, request: Request) -> dict[str, Any]:
        """Admin: per route and shadow variant, the comparisons of mirrored requests (all
        router replicas), this replica's mirrors in flight, and the disagreeing pairs it kept
        (``keep_samples``)."""
        self._require_admin(request)
        try:
            book = await asyncio.wait_for(self.controller.shadow_snapshot.remote(),
                                          CONTROLLER_TIMEOUT_S)
        except Exception as e:
            raise MeshError(503, f"the rollout controller did not answer ({type(e).__name__}); "
                            "retry", code="controller_unavailable",
                            headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return self.shadows.status(book)

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
                            headers={"Retry-After": str(RETRY_AFTER_S)}) from None


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve application builder: ``import_path: serve_app.router:build_app``."""
    router = serve.deployment(MeshRouter, **options(ROUTER_OPTIONS))
    controller = serve.deployment(RolloutController, **options(CONTROLLER_OPTIONS))
    return router.bind(controller.bind())
