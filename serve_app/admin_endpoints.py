"""The router's operator endpoints: ``/health`` (a probe; more for an admin) and ``/admin/*``
(adapters, shadow comparisons, rollouts). A mixin of ``MeshRouter``
(:mod:`serve_app.router`), registered on the shared :data:`~serve_app.http_app.app`: it reads
the router's config, availability, rollout client and controller, and changes nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from serve_app.common.config import RouterConfig
from serve_app.common.errors import MeshError
from serve_app.common.failures import RETRY_AFTER_S
from serve_app.http_app import app
from serve_app.tenancy.keys import authenticate

#: Seconds an admin call waits for the rollout controller.
CONTROLLER_TIMEOUT_S = 10


class AdminEndpoints:
    """``/health`` and ``/admin/*`` of ``MeshRouter`` (a mixin: it uses the router's
    ``config``, ``availability``, ``variants``, ``rollouts``, ``controller``, ``shadows`` and
    ``_require_config``)."""

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
