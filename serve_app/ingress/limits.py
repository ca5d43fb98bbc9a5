"""Per-tenant request limits, enforced by each router replica on its own traffic.

- ``max_concurrent_requests``: requests in flight (a stream counts until it ends).
- ``requests_per_minute``: a token bucket holding ``rpm`` tokens, refilled at ``rpm / 60``
  tokens per second (the usual token-bucket rate limiter).

With N router replicas a tenant can get up to N times its limits; the shipped configs run one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError


@dataclass
class _TenantState:
    in_flight: int = 0
    tokens: float = 0.0
    refilled_at: float = field(default_factory=lambda: time.monotonic())


class TenantLimiter:
    """Admit or refuse requests per tenant."""

    def __init__(self) -> None:
        self._state: dict[str, _TenantState] = {}

    def acquire(self, tenant: Tenant | None) -> None:
        """Count a new request of ``tenant`` (no-op in open mode).

        Raises:
            MeshError: 429 with ``Retry-After`` (s) when a limit is reached.
        """
        if tenant is None:
            return
        st = self._state.setdefault(tenant.id, _TenantState(
            tokens=float(tenant.requests_per_minute or 0)))
        if tenant.max_concurrent_requests and st.in_flight >= tenant.max_concurrent_requests:
            raise MeshError(429, f"tenant {tenant.id!r} has {st.in_flight} requests in flight; "
                            f"the limit is {tenant.max_concurrent_requests}",
                            code="concurrency_limit_exceeded", headers={"Retry-After": "1"})
        if tenant.requests_per_minute:
            rate = tenant.requests_per_minute / 60.0
            now = time.monotonic()
            st.tokens = min(float(tenant.requests_per_minute),
                            st.tokens + (now - st.refilled_at) * rate)
            st.refilled_at = now
            if st.tokens < 1.0:
                wait_s = math.ceil((1.0 - st.tokens) / rate)
                raise MeshError(429, f"tenant {tenant.id!r} is over its limit of "
                                f"{tenant.requests_per_minute} requests per minute",
                                code="rate_limit_exceeded", headers={"Retry-After": str(wait_s)})
            st.tokens -= 1.0
        st.in_flight += 1

    def release(self, tenant: Tenant | None) -> None:
        """A request of ``tenant`` ended."""
        if tenant is not None and tenant.id in self._state:
            self._state[tenant.id].in_flight -= 1
