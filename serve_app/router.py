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
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError
from ray import serve

from serve_app.common.logs import get_logger
from serve_app.common.config import RouterConfig
from serve_app.common.deployment_options import CONTROLLER_OPTIONS, ROUTER_OPTIONS, options
from serve_app.common.failures import RETRY_AFTER_S
from serve_app.common.errors import MeshError, format_validation_error, reject_user_config
from serve_app.admin_endpoints import CONTROLLER_TIMEOUT_S, AdminEndpoints
from serve_app.dispatch.account import RequestAccount
from serve_app.http_app import app
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

#: The request id header. Serve's ingress puts it on every request (the client's own, or a new
#: one) and on every response, so the router only reads it (a new UUID without one: a call
#: through a handle).
REQUEST_ID_HEADER = "x-request-id"

@serve.ingress(app)
class MeshRouter(AdminEndpoints):
    """OpenAI-compatible ingress that splits each route's traffic across variant apps
    (``/health`` and ``/admin/*``: :class:`~serve_app.admin_endpoints.AdminEndpoints`).

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
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        account = RequestAccount(self.metrics, self.rollouts.observe, planner.labels(None, None),
                                 request_id)
        quota_headers: dict[str, str] = {}
        tenant = body = plan = None
        try:
            tenant = authenticate(self._tenants, request.headers.get("authorization"))
            body = await read_json_body(request)
            plan = await planner.plan(endpoint, body, tenant, request_id=request_id,
                                      session_id=request.headers.get(SESSION_HEADER),
                                      pinned=request.headers.get(VARIANT_HEADER))
            account.labelled(plan.tags, plan.arms)
            quota_headers = await account.hold_tenant_slot(self.limiter, tenant, Reservation.of(
                endpoint, body, self.variants.context_len(plan.candidates)))
            # From here on only the plan is read: a deploy during the await above may have
            # changed (or removed) the route in self.config.
            capture = self.shadows.maybe_mirror(plan, effective_shadow(
                plan.shadow, self.rollouts.shadow_phase(plan.route)), plan.identity, request_id)
            account.mirrored(capture)
            response = await self.dispatcher.dispatch(plan, account)
            response.headers.update(quota_headers)  # OpenAI's x-ratelimit-* headers
            return response
        except BaseException as e:  # a refusal, the client leaving, or a bug: counted once
            account.ended_by(e, None if plan else planner.labels(tenant, body), quota_headers)
            raise

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        """OpenAI ``GET /v1/models``: the routes (and ``route:adapter``) the caller may use."""
        self._require_config()
        tenant = authenticate(self._tenants, request.headers.get("authorization"))
        return {"object": "list", "data": [
            {"id": i, "object": "model", "created": 0, "owned_by": "model-mesh"}
            for i in self.planner.model_ids(tenant)]}


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve application builder: ``import_path: serve_app.router:build_app``."""
    router = serve.deployment(MeshRouter, **options(ROUTER_OPTIONS))
    controller = serve.deployment(RolloutController, **options(CONTROLLER_OPTIONS))
    return router.bind(controller.bind())
