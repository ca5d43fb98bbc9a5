"""Pydantic schemas of the callers in the ``MeshRouter`` deployment's ``user_config``:
:class:`Tenant` (an API-key identity, its routes, adapters, limits and priority) and
:class:`LedgerConfig` (where every router replica counts the tenants' limits). Applied in
place by ``reconfigure()``, as part of :class:`~serve_app.common.config.RouterConfig`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from serve_app.common.config_rules import (MAX_CONCURRENT_REQUESTS, MAX_REQUESTS_PER_MINUTE,
                                           MAX_TOKENS_BUDGET, NAME_PATTERN, check_name)
from serve_app.common.policies import Strict

SHA256_HEX = r"^[0-9a-f]{64}$"


class Tenant(Strict):
    """A caller identity, authenticated by API key (``Authorization: Bearer <key>``).

    Attributes:
        id: tenant name (metrics label, logs).
        api_keys_sha256: SHA-256 hex digests of the tenant's API keys; keys themselves are
            never stored (``meshctl hash-key`` prints a digest).
        admin: may pin a variant with the ``x-mesh-variant`` request header and read
            ``/admin/*``.
        routes: routes the tenant may call; ``["*"]`` for all.
        adapters: adapter names the tenant owns and may call (``route:adapter``).
        max_concurrent_requests: requests in flight at once, across every router replica
            (429 above; :mod:`serve_app.tenancy.limits`).
        requests_per_minute: request rate, across every router replica (429 above).
        tokens_per_minute / tokens_per_day: token budgets (prompt + completion tokens),
            across every router replica: a request reserves its estimated prompt plus its
            ``max_tokens`` at admission and settles with its real usage when it ends (429
            ``tokens_exhausted`` when the reservation does not fit;
            :mod:`serve_app.tenancy.token_budget`).
        limits_fail_mode: what a router does with a limited tenant's request while the
            cluster-wide counts do not answer: ``open`` counts it on that router replica
            alone, within its share of each limit (the limit divided by the router replicas
            running), ``closed`` refuses it (503 ``limits_unavailable`` with
            ``Retry-After``).
        priority: the tenant's priority under contention, in vLLM's convention: lower is
            served first (default 0). It orders the router's admission queues, and reaches
            vLLM as the request ``priority`` on engines with ``scheduling_policy: priority``.
        shadow: false opts the tenant's requests out of shadow traffic (never mirrored).
    """

    id: str = Field(pattern=NAME_PATTERN)
    api_keys_sha256: list[str] = Field(min_length=1)
    admin: bool = False
    routes: list[str] = Field(default_factory=lambda: ["*"])
    adapters: list[str] = Field(default_factory=list)
    max_concurrent_requests: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT_REQUESTS)
    requests_per_minute: int | None = Field(default=None, ge=1, le=MAX_REQUESTS_PER_MINUTE)
    tokens_per_minute: int | None = Field(default=None, ge=1, le=MAX_TOKENS_BUDGET)
    tokens_per_day: int | None = Field(default=None, ge=1, le=MAX_TOKENS_BUDGET)
    limits_fail_mode: Literal["open", "closed"] = "open"
    priority: int = Field(default=0, ge=-1000, le=1000)
    shadow: bool = True

    @field_validator("api_keys_sha256")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        for digest in v:
            if not re.fullmatch(SHA256_HEX, digest):
                raise ValueError(f"{digest[:12]!r}... is not a SHA-256 hex digest (64 lowercase "
                                 "hex characters); store hashes, never keys: meshctl hash-key")
        return v

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: list[str]) -> list[str]:
        for adapter in v:
            check_name("adapter name", adapter)
        return v

    @model_validator(mode="after")
    def _day_holds_a_minute(self) -> Tenant:
        if self.tokens_per_day is not None and self.tokens_per_minute is not None \
                and self.tokens_per_day < self.tokens_per_minute:
            raise ValueError(
                f"tenant {self.id!r}: tokens_per_day ({self.tokens_per_day}) is below "
                f"tokens_per_minute ({self.tokens_per_minute}), so the per-minute budget "
                "could never be used (were they swapped?); set tokens_per_day to at least "
                "tokens_per_minute, or remove tokens_per_minute")
        return self

    def may_call(self, route: str) -> bool:
        return "*" in self.routes or route in self.routes


class LedgerConfig(Strict):
    """Where the tenant counts of every router replica are kept (``MeshRouter``
    ``user_config`` ``ledger``; :mod:`serve_app.tenancy.ledger`).

    Attributes:
        backend: ``actor`` (default: a Ray actor that keeps its buckets in the Ray GCS) or
            ``redis`` (a Redis server, which outlives the Ray cluster).
        redis_url: ``redis://host:port/db`` of the server, for ``backend: redis``.
        leases: each router replica holds a lease on each busy tenant's budget and counts
            its requests there, with no ledger call per request (default); false asks the
            ledger for every request of a limited tenant (:mod:`serve_app.tenancy.limits`).
    """

    backend: Literal["actor", "redis"] = "actor"
    redis_url: str | None = None
    leases: bool = True

    @model_validator(mode="after")
    def _url_for_redis(self) -> LedgerConfig:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("ledger.backend redis needs ledger.redis_url, e.g. "
                             "redis://127.0.0.1:6379/0")
        if self.backend == "actor" and self.redis_url:
            raise ValueError(f"ledger.redis_url {self.redis_url!r} is set but ledger.backend "
                             "is actor, which keeps the counts in a Ray actor and would never "
                             "use the server: set backend: redis, or remove redis_url")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://",
                                                              "unix://")):
            raise ValueError(f"ledger.redis_url {self.redis_url!r} is not a Redis URL "
                             "(redis://host:port/db, rediss://..., unix://path)")
        return self
