"""Pydantic schemas for what the Serve config declares about the mesh.

- :class:`VariantArgs`: a variant application's ``args`` (base model and vLLM engine args);
  changing them restarts the variant's replicas.
- :class:`ReplicaConfig`: the ``LLMReplica`` deployment's ``user_config``; applied in place
  by ``reconfigure()``.
- :class:`RouterConfig`: the ``MeshRouter`` deployment's ``user_config`` (routes, weights);
  applied in place by ``reconfigure()``.

This module holds the router's schemas; the variant's are in
:mod:`~serve_app.common.variant_config`, the tenants' in :mod:`~serve_app.common.tenant_config`,
and the names and bounds they share in :mod:`~serve_app.common.config_rules`. Every one of
them is importable from here.

Validation errors name the path of the bad field (pydantic's ``loc``); see
:func:`format_validation_error`.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from serve_app.common.config_rules import (MAX_CONCURRENT_REQUESTS, MAX_REQUESTS_PER_MINUTE,
                                           MAX_TOKENS_BUDGET, MAX_WEIGHT, NAME_PATTERN,
                                           check_name, duplicates)
from serve_app.common.policies import (Admission, RolloutPolicy, ShadowConfig,
                                       Strict)
from serve_app.common.tenant_config import SHA256_HEX, LedgerConfig, Tenant
from serve_app.common.variant_config import (AdapterRef, FaultInjection, ReplicaConfig,
                                             SimArgs, VariantArgs, gpu_accelerator_types)

__all__ = [
    "NAME_PATTERN", "MAX_WEIGHT", "MAX_CONCURRENT_REQUESTS", "MAX_REQUESTS_PER_MINUTE",
    "MAX_TOKENS_BUDGET", "SHA256_HEX", "check_name", "duplicates",
    "SimArgs", "VariantArgs", "gpu_accelerator_types", "AdapterRef", "FaultInjection",
    "ReplicaConfig", "VariantWeight", "VersionWeight", "AdapterSplit", "RouteConfig",
    "Tenant", "ResidentBudget", "LedgerConfig", "RouterConfig",
]


def _single_owner(pairs, describe) -> None:
    """Raise ``ValueError(describe(item, first_owner, other_owner))`` if an item of the
    ``(item, owner)`` pairs has two owners."""
    owner: dict[str, str] = {}
    for item, who in pairs:
        if owner.setdefault(item, who) != who:
            raise ValueError(describe(item, owner[item], who))


# ---------------------------------------------------------------------------------------------
# Router: routes and weights
# ---------------------------------------------------------------------------------------------

def _check_weights(what: str, weighted: list[tuple[str, int]]) -> None:
    """Rules every weighted split shares (route variants, adapter versions)."""
    if dupes := duplicates([arm for arm, _ in weighted]):
        raise ValueError(f"{what} listed twice: {', '.join(dupes)}")
    if sum(w for _, w in weighted) <= 0:
        raise ValueError("weights sum to 0: give at least one a positive weight")


def _check_rollout(what: str, n_arms: int, rollout: RolloutPolicy | None) -> None:
    if rollout is not None and n_arms != 2:
        raise ValueError(f"a rollout needs exactly two {what}s, stable first and canary last; "
                         f"got {n_arms}")


class VariantWeight(Strict):
    """One variant of a route and its integer weight (0: deployed, gets no new traffic)."""

    application: str = Field(pattern=NAME_PATTERN)
    weight: int = Field(ge=0, le=MAX_WEIGHT)


class VersionWeight(Strict):
    """One version of an adapter and its integer weight."""

    version: int = Field(ge=1)
    weight: int = Field(ge=0, le=MAX_WEIGHT)


class AdapterSplit(Strict):
    """An adapter version canary: callers of ``route:<name>`` split between versions.

    Every version listed must be served by a variant of the route (its ``LLMReplica``
    ``user_config.adapters`` lists both). Stable version first, canary last.
    """

    versions: list[VersionWeight] = Field(min_length=1)
    rollout: RolloutPolicy | None = None

    @field_validator("versions")
    @classmethod
    def _weights(cls, v: list[VersionWeight]) -> list[VersionWeight]:
        _check_weights("version", [(f"v{x.version}", x.weight) for x in v])
        return v

    @model_validator(mode="after")
    def _rollout_arms(self) -> AdapterSplit:
        _check_rollout("version", len(self.versions), self.rollout)
        if self.rollout is not None and self.rollout.shadow is not None:
            raise ValueError("rollout.shadow: a shadow phase mirrors a route's variants; an "
                             "adapter version rollout cannot have one")
        return self


class RouteConfig(Strict):
    """A route: the variants a client's ``model`` name maps to, laid out in this order.

    Sticky assignment maps callers onto [0, 1) in variant order, so list the stable variant
    first and the canary last: raising the canary's weight then only moves callers to it.

    Attributes:
        variants: the variant applications and their weights.
        salt: hash salt of the sticky split; defaults to the route name.
        rollout: progressive rollout of the last variant (see :class:`RolloutPolicy`).
        adapters: adapter name -> version split (adapter version canaries).
        admission: bounded queues and priority under load (see :class:`Admission`).
        shadow: mirror a share of the requests to another variant (:class:`ShadowConfig`).
        merged: adapter name -> a variant application whose model has that adapter merged
            into its weights (``scripts/prepare_model.py --merge-adapter``). Requests for the
            adapter go there first, with no LoRA cost, while it runs and holds the version
            the request would get; the route's LoRA variants are the failover. It takes no
            other traffic (it is not one of ``variants``).
        cold_start_timeout_s: longest a request waits for a variant that scaled to zero
            (``autoscaling_config.min_replicas: 0``) to start, s, when no other variant of
            the route runs; 503 ``cold_start_timeout`` with ``Retry-After`` past it. The
            default covers a replica start on a 2-core host (~75 s) with margin.
    """

    variants: list[VariantWeight] = Field(min_length=1)
    salt: str | None = Field(default=None, description="hash salt; defaults to the route name")
    rollout: RolloutPolicy | None = None
    adapters: dict[str, AdapterSplit] = Field(default_factory=dict)
    admission: Admission = Field(default_factory=Admission)
    shadow: ShadowConfig | None = None
    merged: dict[str, str] = Field(default_factory=dict)
    cold_start_timeout_s: float = Field(default=180.0, gt=0, le=1800)

    @field_validator("merged")
    @classmethod
    def _merged_names(cls, v: dict[str, str]) -> dict[str, str]:
        for adapter, app in v.items():
            if "@" in adapter:
                raise ValueError(f"merged: {adapter!r}: name the adapter without a version "
                                 "(the merged variant's model says which version it holds)")
            check_name("merged: adapter name", adapter)
            check_name(f"merged.{adapter}: application", app)
        return v

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: dict[str, AdapterSplit]) -> dict[str, AdapterSplit]:
        for adapter in v:
            check_name("adapters: adapter name", adapter)
        return v

    @field_validator("variants")
    @classmethod
    def _weights(cls, v: list[VariantWeight]) -> list[VariantWeight]:
        _check_weights("variant", [(x.application, x.weight) for x in v])
        return v

    @model_validator(mode="after")
    def _rollout_arms(self) -> RouteConfig:
        _check_rollout("variant", len(self.variants), self.rollout)
        variants = {w.application for w in self.variants}
        if both := sorted(variants & set(self.merged.values())):
            raise ValueError(f"merged: {', '.join(both)} is also one of the route's variants; "
                             "a merged variant serves its adapter only: remove it from "
                             "`variants`")
        if self.shadow is not None and self.rollout is not None and self.rollout.shadow:
            raise ValueError("a route has one shadow at a time: remove `shadow:` while its "
                             "rollout has a shadow phase (rollout.shadow)")
        return self


class ResidentBudget(Strict):
    """A mesh-wide budget of resident variants (``MeshRouter`` ``user_config``
    ``resident_budget``; :mod:`serve_app.variants.resident_budget`).

    Attributes:
        max_variants: most variant applications with a replica (starting, running or
            stopping) at once. A cold start that would pass it first evicts the least
            recently used idle variant whose ``autoscaling_config.policy`` is the
            resident-budget policy (:mod:`serve_app.control.resident_policy`); with none
            idle, 503
            ``resident_budget_full`` with ``Retry-After``.
        evict_timeout_s: longest a cold start waits for the evicted variant to reach zero
            replicas, s; past it, 503 ``resident_budget_full``.
    """

    max_variants: int = Field(ge=1, le=10_000)
    evict_timeout_s: float = Field(default=60.0, gt=0, le=600)


class RouterConfig(Strict):
    """``user_config`` of the ``MeshRouter`` deployment.

    Attributes:
        routes: route name (the OpenAI ``model`` field) -> its variants and weights.
        tenants: who may call; empty means open mode (no auth, logged loudly, no pinning).
        resident_budget: optional budget of resident variants (:class:`ResidentBudget`).
        ledger: where tenant limits are counted (:class:`LedgerConfig`; default the actor).
    """

    routes: dict[str, RouteConfig] = Field(min_length=1)
    tenants: list[Tenant] = Field(default_factory=list)
    resident_budget: ResidentBudget | None = None
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)

    @model_validator(mode="after")
    def _tenants_consistent(self) -> RouterConfig:
        if dupes := duplicates([t.id for t in self.tenants]):
            raise ValueError(f"tenant id listed twice: {', '.join(dupes)}")
        _single_owner(((d, t.id) for t in self.tenants for d in t.api_keys_sha256),
                      lambda d, a, b: f"API key {d[:12]}... belongs to both {a!r} and {b!r}")
        _single_owner(((n, t.id) for t in self.tenants for n in t.adapters),
                      lambda n, a, b: f"adapter {n!r} is owned by both {a!r} and {b!r}; an "
                                      "adapter belongs to one tenant")
        for t in self.tenants:
            for route in t.routes:
                if route != "*" and route not in self.routes:
                    raise ValueError(f"tenant {t.id!r} names unknown route {route!r}")
        return self

    def top_priority(self) -> int:
        """The best (lowest) tenant priority configured; 0 in open mode."""
        return min((t.priority for t in self.tenants), default=0)

    def tenant_by_key_digest(self) -> dict[str, Tenant]:
        """SHA-256 digest of an API key -> its tenant."""
        return {d: t for t in self.tenants for d in t.api_keys_sha256}

    @field_validator("routes")
    @classmethod
    def _route_names(cls, v: dict[str, RouteConfig]) -> dict[str, RouteConfig]:
        for name in v:
            check_name("route name", name)
        return v

    def applications(self) -> set[str]:
        """Every variant application any route names (``variants`` and ``merged``)."""
        return {w.application for r in self.routes.values() for w in r.variants} | {
            a for r in self.routes.values() for a in r.merged.values()}
