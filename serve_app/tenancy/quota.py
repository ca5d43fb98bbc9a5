"""A tenant's limits as the counts take them (:class:`Limits`), and what a decision leaves it
(:class:`Quota`, sent as OpenAI's ``x-ratelimit-*`` headers): the terms the counts
(:mod:`serve_app.tenancy.counts`), the budget leases (:mod:`serve_app.tenancy.lease_terms`),
the ledgers and the router's limiter share. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from serve_app.common.config import Tenant
from serve_app.tenancy.token_budget import WINDOW_S, duration_header

#: The tenant's limits that are token buckets, with their windows (s). The requests bucket
#: draws 1 per request, the token buckets a request's reserved tokens (:func:`draw`).
REQUESTS = "requests_per_minute"
BUCKET_WINDOWS_S = {REQUESTS: 60.0, **WINDOW_S}


def draw(bucket_name: str, tokens: int) -> int:
    """What one request reserving ``tokens`` draws from the bucket ``bucket_name``."""
    return 1 if bucket_name == REQUESTS else tokens


@dataclass(frozen=True)
class Limits:
    """A tenant's limits as the counts need them (picklable; None: no such limit)."""

    max_concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    @classmethod
    def of(cls, tenant: Tenant) -> Limits:
        return cls(tenant.max_concurrent_requests, tenant.requests_per_minute,
                   tenant.tokens_per_minute, tenant.tokens_per_day)

    def __bool__(self) -> bool:
        return any(v is not None for v in astuple(self))

    def buckets(self) -> dict[str, int]:
        """Limit per bucket name (:data:`BUCKET_WINDOWS_S`), for the limits set."""
        return {name: getattr(self, name) for name in BUCKET_WINDOWS_S
                if getattr(self, name) is not None}


@dataclass(frozen=True)
class Quota:
    """What a tenant has left after a decision (limit, remaining, seconds until full), for
    OpenAI's rate-limit headers. ``tokens`` is the per-minute budget, or the per-day one
    when only that is set."""

    requests: tuple[int, int, float] | None = None
    tokens: tuple[int, int, float] | None = None
    #: ``(bucket name, what is left in it)`` for every bucket, (tokens or requests, may be
    #: negative: a debt): what a router falling back to local counts takes its share of.
    left: tuple[tuple[str, float], ...] = ()

    def headers(self) -> dict[str, str]:
        """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits set."""
        out = {}
        for kind, figures in (("requests", self.requests), ("tokens", self.tokens)):
            if figures is not None:
                limit, remaining, reset_s = figures
                out |= {f"x-ratelimit-limit-{kind}": str(limit),
                        f"x-ratelimit-remaining-{kind}": str(remaining),
                        f"x-ratelimit-reset-{kind}": duration_header(reset_s)}
        return out
