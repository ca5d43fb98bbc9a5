"""``RequestPlanner``: what to do with one request, decided before anything is sent.

It turns (tenant, body, headers, router config, variant availability, weights in force)
into a frozen :class:`RequestPlan`: the route, the adapter and its version, the variants to
try in order, the rollout arms the request goes through, the tenant's priority and the
metric labels. It knows nothing of Serve or HTTP (the router passes headers as strings), so
it is unit-tested without Ray (``tests/unit/request/test_planner.py``).

Rules, in order:

1. ``model`` names a route (``smollm``) or ``route:adapter`` (``smollm:acme-support``);
   anything else is 400 (not a string) or 404 ``model_not_found``.
2. A tenant calls only its routes (403) and its own adapters: an adapter it does not own is
   404 ``model_not_found``, the very answer a name no one owns gets (a 403 would tell it
   that another tenant's adapter exists); an adapter no variant of the route serves is 404.
3. An adapter with a version split (``routes.<route>.adapters``) gets the caller's sticky
   version; the variants are those of the route that serve it.
4. ``x-mesh-variant`` pins a variant (admin only, 403 otherwise); else the caller's sticky
   variant comes first, then :func:`~serve_app.request.split.failover_order`, the variants
   with a running replica before the others. A chosen variant that scaled to zero is
   woken (``RequestPlan.wake``) while a running one serves; with none running, the request
   waits for the cold start (:mod:`serve_app.variants.cold_start`).
   An adapter with a merged variant (``routes.<route>.merged``) goes to it first, while it
   runs and its model holds the very version the request would get on the LoRA path (the
   version split's choice, else the first LoRA variant's default); the LoRA variants follow.
5. ``priority`` is the tenant's, from the config: a ``priority`` in the body, whatever its
   value (the tenant's own included), is refused with 400 ``priority_not_allowed``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from serve_app.common.adapters import adapter_name
from serve_app.common.config import RouterConfig, Tenant
from serve_app.common.errors import MeshError
from serve_app.common.policies import ShadowConfig
from serve_app.common.wire import GenerateRequest
from serve_app.request.split import Split, failover_order, pick_variant

VARIANT_HEADER = "x-mesh-variant"
SESSION_HEADER = "x-session-id"
#: Metric label value for a name that is not in the config (labels never come from clients).
UNKNOWN = "unknown"


class Availability(Protocol):
    """What the planner asks of the availability view (:mod:`serve_app.variants.availability`)."""

    adapters: dict[str, set[str]]

    def serves(self, application: str, adapter: str) -> bool: ...

    def is_available(self, application: str) -> bool: ...

    def version_for(self, application: str, adapter: str) -> str | None: ...

    def merged(self, application: str) -> str: ...

    def prefer_available(self, candidates: list[str]) -> list[str]: ...

    def is_asleep(self, application: str) -> bool: ...

    def may_be_asleep(self, application: str) -> bool: ...

    async def refresh(self, max_age_s: float = 0.0) -> None: ...


@dataclass(frozen=True)
class RequestPlan:
    """Everything the router needs to serve one request.

    Everything a request needs after planning is here, so a deploy that changes the router
    config while the request waits (for its tenant slot, say) cannot change or break it.

    Attributes:
        request: what each candidate's replica is sent (the body, the adapter version an
            adapter split chose, the tenant's priority, the request id), built once.
        route: the route (``model`` before the ``:``).
        adapter: the adapter name after the ``:``; "" for the base model.
        candidates: variant applications to try, in order.
        arms: ``(split key, arm)`` pairs the request goes through, for rollouts; an empty
            arm stands for the variant that will serve.
        tenant: the caller (None in open mode).
        priority: the tenant's priority (lower is served first).
        top_priority: it is the best priority configured (may use reserved slots).
        queue_timeout_s: the route's admission timeout, s.
        identity: the caller's sticky identity (:func:`caller_identity`), if any.
        shadow: the route's configured shadow (``routes.<route>.shadow``), if any.
        cold_start_timeout_s: the route's ``cold_start_timeout_s``, s.
        wake: the variant the split chose when it is asleep (scaled to zero) and another
            candidate runs: the dispatcher wakes it in the background and serves this
            request elsewhere; None otherwise.
    """

    request: GenerateRequest
    route: str
    adapter: str
    candidates: tuple[str, ...]
    arms: tuple[tuple[str, str], ...]
    tenant: Tenant | None
    top_priority: bool
    queue_timeout_s: float
    identity: str | None = None
    shadow: ShadowConfig | None = None
    cold_start_timeout_s: float = 180.0
    wake: str | None = None

    @property
    def stream(self) -> bool:
        """The client asked for SSE (``stream: true``)."""
        return self.request.body.get("stream") is True

    @property
    def version(self) -> str | None:
        """The adapter version (``name@vN``) an adapter split chose, else None (the variant
        uses its default version)."""
        return self.request.adapter_version

    @property
    def priority(self) -> int:
        """The tenant's priority (lower is served first)."""
        return self.request.priority

    @property
    def tags(self) -> dict[str, str]:
        """Metric labels (route, tenant, adapter; the variant is added when one answers)."""
        return {"route": self.route, "variant": "", "tenant": self.tenant.id if self.tenant
                else "", "adapter": self.adapter}


def caller_identity(session_id: str | None, body: dict[str, Any], tenant: Tenant | None
                    ) -> str | None:
    """The identity that keeps a caller on one variant, most specific first:
    ``x-session-id`` header, then the OpenAI ``user`` field, then the tenant id."""
    return _session(session_id, body) or (tenant.id if tenant else None)


def _session(session_id: str | None, body: dict[str, Any]) -> str | None:
    """The ``x-session-id`` header, else the OpenAI ``user`` field, else None."""
    user = body.get("user")
    return session_id or (user if isinstance(user, str) and user else None)


def conversation(session_id: str | None, body: dict[str, Any], tenant: Tenant | None
                 ) -> str | None:
    """The caller's conversation for replica affinity: a digest of the tenant and its
    ``x-session-id``, else of its ``user`` (:func:`session_key`); None without either (a
    tenant is many conversations, not one)."""
    session = _session(session_id, body)
    return session_key(tenant.id if tenant else "", session) if session else None


def session_key(tenant_id: str, session: str) -> str:
    """The key a conversation is remembered by: 32 hex characters (BLAKE2b, 16 bytes) of
    ``tenant_id`` and ``session``, whatever its length: a client's ids of any size cost the
    replica router's table the same (tenants apart: the same id of two tenants is two keys)."""
    return hashlib.blake2b(f"{tenant_id}\0{session}".encode("utf-8", "surrogatepass"),
                           digest_size=16).hexdigest()


def _no_such_model(model: str) -> MeshError:
    """404 ``model_not_found`` for a ``model`` the caller cannot use: no such route, a
    version in it, or an adapter the caller does not own (whoever else may)."""
    return MeshError(404, f"The model {model!r} does not exist. See GET /v1/models for the "
                     "models you can use.", param="model", code="model_not_found")


class RequestPlanner:
    """Plans requests for one router config.

    Args:
        config: the router's ``user_config``.
        splits: its splits (:func:`serve_app.request.split.splits_of`).
        weights_in_force: ``(split key, split) -> [(arm, weight)]`` in force (a rollout may
            own the weights); called with this config's own split, so a request planned
            under this config never looks a key up in another one's splits.
        availability: which variants run, and which adapters they serve.
    """

    def __init__(self, config: RouterConfig, splits: dict[str, Split],
                 weights_in_force: Callable[[str, Split], list[tuple[str, int]]],
                 availability: Availability) -> None:
        self.config = config
        self.splits = splits
        self._weights_in_force = weights_in_force
        self.availability = availability
        self.top_priority = config.top_priority()
        self.owned_adapters = {a for t in config.tenants for a in t.adapters}

    def weighted(self, key: str) -> list[tuple[str, int]]:
        """The arms of this config's split ``key`` with the weights in force."""
        return self._weights_in_force(key, self.splits[key])

    def model_ids(self, tenant: Tenant | None) -> list[str]:
        """The ``model`` names the caller may use (``GET /v1/models``): its routes, and
        ``route:adapter`` for its adapters that a variant of the route serves now."""
        ids = []
        for route, rc in self.config.routes.items():
            if tenant is not None and not tenant.may_call(route):
                continue
            ids.append(route)
            served = {adapter_name(key) for v in rc.variants
                      for key in self.availability.adapters.get(v.application, ())}
            ids += [f"{route}:{a}" for a in sorted(served)
                    if tenant is None or a in tenant.adapters]
        return ids

    def labels(self, tenant: Tenant | None, body: Any) -> dict[str, str]:
        """Metric labels for a request refused before it was planned: every value comes from
        the config, anything else folds into :data:`UNKNOWN` (clients cannot grow series)."""
        model = body.get("model") if isinstance(body, dict) else None
        route, _, adapter = model.partition(":") if isinstance(model, str) else ("", "", "")
        if route and route not in self.config.routes:
            route, adapter = UNKNOWN, ""
        if adapter and not self._known_adapter(adapter):
            adapter = UNKNOWN
        return {"route": route, "variant": "", "tenant": tenant.id if tenant else "",
                "adapter": adapter}

    def _known_adapter(self, adapter: str) -> bool:
        """A tenant owns ``adapter``, or a variant of the config serves (or, asleep,
        declares) it: a name that may be a metric label."""
        return adapter in self.owned_adapters or any(
            self.availability.serves(v, adapter) for v in self.config.applications())

    async def plan(self, endpoint: str, body: dict[str, Any], tenant: Tenant | None, *,
                   request_id: str | None = None, session_id: str | None = None,
                   pinned: str | None = None) -> RequestPlan:
        """Plan one request.

        Args:
            endpoint: ``"chat"`` or ``"completion"``.
            body: the parsed JSON body.
            tenant: the authenticated caller (None in open mode).
            request_id: the request's ``x-request-id`` (vLLM's request id too).
            session_id: the ``x-session-id`` header, if any.
            pinned: the ``x-mesh-variant`` header, if any.

        Raises:
            MeshError: 400, 403 or 404, with the field at fault and how to fix it.
        """
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise MeshError(400, "you must provide a model parameter (a route name, e.g. "
                            f"{next(iter(self.config.routes))!r}, or route:adapter; see "
                            "GET /v1/models)", param="model")
        route, _, adapter = model.partition(":")
        if route not in self.config.routes or "@" in adapter:
            raise _no_such_model(model)
        if tenant and not tenant.may_call(route):
            raise MeshError(403, f"tenant {tenant.id!r} may not call model {route!r}",
                            param="model", code="model_not_allowed")
        priority = tenant.priority if tenant else 0
        if "priority" in body:  # even the tenant's own: the mesh sets it, one rule
            raise MeshError(400, "the request field `priority` is set by the mesh from your "
                            f"tenant's config (yours is {priority}); remove it from the "
                            "request", param="priority", code="priority_not_allowed")
        identity = caller_identity(session_id, body, tenant)

        weighted = self.weighted(route)
        version = wake = None
        if adapter:
            if tenant is not None and adapter not in tenant.adapters:
                raise _no_such_model(model)  # another's, or no one's: the same answer
            version = await self._pick_version(route, adapter, identity)
            weighted = await self._serving(weighted, model, version or adapter)
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
            first = pick_variant(weighted, self.splits[route].salt, identity)
            order = failover_order(weighted, first)
            if self.availability.may_be_asleep(order[0]):
                # Idle and scaling to zero: it may have gone to zero since the last status
                # poll, and a call to its handle would wait for a cold start rather than be
                # served by the variant that runs.
                await self.availability.refresh(max_age_s=0.5)
            candidates = self.availability.prefer_available(order)
            if candidates[0] != order[0] and self.availability.is_asleep(order[0]):
                wake = order[0]  # the split's choice sleeps: wake it, serve this one elsewhere
            if adapter and (merged := self._merged_variant(route, adapter, version,
                                                           candidates[0])):
                merged_app, version = merged  # the version pinned: both paths serve the same
                candidates = [merged_app, *candidates]
        # Rollouts judge only traffic the split chose (not pinned requests).
        arms = [] if pinned else [(route, "")]
        if version:
            arms.append((f"{route}:{adapter}", version))
        rc = self.config.routes[route]
        return RequestPlan(
            request=GenerateRequest(endpoint, body, version, priority, request_id,
                                    session=conversation(session_id, body, tenant),
                                    queue_timeout_s=rc.admission.queue_timeout_s),
            route=route, adapter=adapter, candidates=tuple(candidates), arms=tuple(arms),
            tenant=tenant, top_priority=priority <= self.top_priority,
            queue_timeout_s=rc.admission.queue_timeout_s, identity=identity, shadow=rc.shadow,
            cold_start_timeout_s=rc.cold_start_timeout_s, wake=wake)

    def _merged_variant(self, route: str, adapter: str, version: str | None,
                        lora_variant: str) -> tuple[str, str] | None:
        """The route's merged variant for ``adapter`` and the version it holds, if it runs
        and holds the version the request gets on ``lora_variant`` (``version``, else that
        variant's default). None while the route or the adapter's split is under a rollout:
        merged-speed answers would skew the arms' figures."""
        rc = self.config.routes[route]
        merged = rc.merged.get(adapter)
        split = rc.adapters.get(adapter)
        if merged is None or rc.rollout is not None or (split and split.rollout is not None) \
                or not self.availability.is_available(merged):
            return None
        wanted = self.availability.version_for(lora_variant, version or adapter)
        return (merged, wanted) if wanted and self.availability.merged(merged) == wanted \
            else None

    async def _pick_version(self, route: str, adapter: str, identity: str | None) -> str | None:
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

        weighted = self.weighted(key)
        chosen = pick_variant(weighted, self.splits[key].salt, identity)
        if not served(chosen):  # a deploy may have just added it: look again first
            await self.availability.refresh()
        return next((v for v in failover_order(weighted, chosen) if served(v)), None)

    async def _serving(self, weighted: list[tuple[str, int]], model: str, adapter: str
                       ) -> list[tuple[str, int]]:
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
