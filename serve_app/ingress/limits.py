"""Per-tenant request limits, held across every router replica.

- ``max_concurrent_requests``: requests in flight (a stream counts until it ends).
- ``requests_per_minute``: a token bucket holding ``rpm`` tokens, refilled at ``rpm / 60``
  tokens per second (the usual token-bucket rate limiter).

:class:`TenantCounts` is the counting, pure. The counts that hold cluster-wide live in one
Ray actor, :class:`SharedTenantCounts` (named, detached, restarted by Ray when it dies), so a
tenant limited to 2 in flight gets 2 across all routers. A router's :class:`TenantLimiter`
asks it once per request of a *limited* tenant (one actor call, about 1 ms here; tenants
without limits cost nothing) and gives the slot back without waiting.

When the shared counts do not answer within :data:`SHARED_TIMEOUT_S`, the router stops asking
for :data:`RETRY_SHARED_S` and applies each tenant's ``limits_fail_mode``: ``open`` counts the
tenant on this router replica alone (the limits then hold per router), ``closed`` refuses
with 503 ``limits_unavailable`` and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.common.logs import get_logger
from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError

logger = get_logger(__name__)

#: The shared counts' actor: name and namespace (one per Ray cluster).
SHARED_NAME, SHARED_NAMESPACE = "mesh-tenant-counts", "model-mesh"
#: Seconds a router waits for the shared counts before using the tenant's fail mode.
SHARED_TIMEOUT_S = 0.5
#: Seconds a router stops asking after the shared counts did not answer.
RETRY_SHARED_S = 5.0


@dataclass
class _TenantState:
    in_flight: int = 0
    tokens: float = 0.0
    refilled_at: float = field(default_factory=lambda: time.monotonic())


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the fields of a :class:`MeshError` (picklable)."""

    status: int
    message: str
    code: str
    retry_after_s: int

    def error(self) -> MeshError:
        return MeshError(self.status, self.message, code=self.code,
                         headers={"Retry-After": str(self.retry_after_s)})


class TenantCounts:
    """In-flight counts and token buckets per tenant id; no I/O."""

    def __init__(self) -> None:
        self._state: dict[str, _TenantState] = {}

    def acquire(self, tenant_id: str, max_concurrent: int | None,
                requests_per_minute: int | None) -> Refusal | None:
        """Count a new request; returns the :class:`Refusal` (429) at a limit, else None."""
        st = self._state.setdefault(tenant_id, _TenantState(
            tokens=float(requests_per_minute or 0)))
        if max_concurrent and st.in_flight >= max_concurrent:
            return Refusal(429, f"tenant {tenant_id!r} has {st.in_flight} requests in flight; "
                           f"the limit is {max_concurrent}", "concurrency_limit_exceeded", 1)
        if requests_per_minute:
            rate = requests_per_minute / 60.0
            now = time.monotonic()
            st.tokens = min(float(requests_per_minute), st.tokens + (now - st.refilled_at) * rate)
            st.refilled_at = now
            if st.tokens < 1.0:
                return Refusal(429, f"tenant {tenant_id!r} is over its limit of "
                               f"{requests_per_minute} requests per minute",
                               "rate_limit_exceeded", math.ceil((1.0 - st.tokens) / rate))
            st.tokens -= 1.0
        st.in_flight += 1
        return None

    def release(self, tenant_id: str) -> None:
        """A counted request ended."""
        st = self._state.get(tenant_id)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1

    def in_flight(self, tenant_id: str) -> int:
        st = self._state.get(tenant_id)
        return st.in_flight if st else 0


@ray.remote(num_cpus=0, max_restarts=-1)
class SharedTenantCounts:
    """The cluster's one :class:`TenantCounts` (a Ray actor: calls run one at a time).

    ``incarnation`` changes when Ray restarts the actor (its counts start from zero), so a
    release meant for an earlier incarnation is ignored rather than freeing a slot twice.
    """

    def __init__(self) -> None:
        self.counts = TenantCounts()
        self.incarnation = uuid.uuid4().hex

    def acquire(self, tenant_id: str, max_concurrent: int | None,
                requests_per_minute: int | None) -> tuple[str, Refusal | None]:
        return self.incarnation, self.counts.acquire(tenant_id, max_concurrent,
                                                     requests_per_minute)

    def release(self, tenant_id: str, incarnation: str) -> None:
        if incarnation == self.incarnation:
            self.counts.release(tenant_id)

    def in_flight(self, tenant_id: str) -> int:
        return self.counts.in_flight(tenant_id)


def shared_tenant_counts():
    """The cluster's :class:`SharedTenantCounts` actor handle. The first router to ask
    creates it on its own node (soft affinity: a node of routers, not one that runs engines
    only); Ray restarts it elsewhere if that node is lost."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return SharedTenantCounts.options(name=SHARED_NAME, namespace=SHARED_NAMESPACE,
                                      lifetime="detached", get_if_exists=True,
                                      scheduling_strategy=here).remote()


@dataclass(frozen=True)
class Lease:
    """One counted request: the shared counts that counted it (``shared`` None: this
    router's own counts)."""

    tenant_id: str
    shared: object | None = None
    incarnation: str = ""

    def give_back(self) -> None:
        """Release the shared count without waiting (its actor may have died: then its
        counts died with it)."""
        try:
            self.shared.release.remote(self.tenant_id, self.incarnation)
        except RayError:
            pass


class TenantLimiter:
    """A router replica's side of the tenant limits: shared counts, with a fallback.

    Args:
        shared: the :class:`SharedTenantCounts` handle, or a factory returning one (called
            again after a failure); None counts on this router only (unit tests).
    """

    def __init__(self, shared=shared_tenant_counts) -> None:
        self._factory = shared if callable(shared) else None
        self._shared = None if callable(shared) else shared
        self._local = TenantCounts()
        self._down_until = 0.0 if shared is not None else math.inf

    async def start(self, timeout_s: float = 30.0) -> None:
        """Look up (or create) the shared counts and wait until they answer, so a router's
        first requests do not wait for the actor to start. On failure the first requests
        find it unavailable (their fail mode applies) and it is looked up again later."""
        if self._factory is None:
            return
        try:
            self._shared = self._factory()
            await asyncio.wait_for(self._shared.in_flight.remote(""), timeout_s)
        except Exception as e:  # noqa: BLE001 - logged; acquire() handles the rest
            logger.warning("shared tenant counts not ready (%s: %s)", type(e).__name__, e)

    async def acquire(self, tenant: Tenant | None) -> Lease | None:
        """Count a new request of ``tenant``; None when it has no limits (nothing to release).

        Raises:
            MeshError: 429 with ``Retry-After`` (s) when a limit is reached; 503
                ``limits_unavailable`` with ``Retry-After`` when the shared counts do not
                answer and the tenant's ``limits_fail_mode`` is ``closed``.
        """
        if tenant is None or not (tenant.max_concurrent_requests or tenant.requests_per_minute):
            return None
        limits = (tenant.id, tenant.max_concurrent_requests, tenant.requests_per_minute)
        if time.monotonic() >= self._down_until:
            lease = await self._acquire_shared(limits)
            if lease is not None:
                return lease
        if tenant.limits_fail_mode == "closed":
            raise MeshError(503, f"tenant {tenant.id!r} has limits and the mesh cannot count "
                            "them right now (limits_fail_mode: closed); retry shortly",
                            code="limits_unavailable",
                            headers={"Retry-After": str(math.ceil(RETRY_SHARED_S))})
        refusal = self._local.acquire(*limits)
        if refusal is not None:
            raise refusal.error()
        return Lease(tenant.id)

    async def _acquire_shared(self, limits: tuple) -> Lease | None:
        """Ask the shared counts; None when they cannot answer in time (raises the 429)."""
        try:
            if self._shared is None:
                self._shared = self._factory()
            shared = self._shared
            answer = asyncio.ensure_future(shared.acquire.remote(*limits))
        except Exception as e:  # noqa: BLE001 - no actor to ask: the fail mode decides
            return self._unavailable(type(e).__name__)
        give_back_if_counted = lambda f: _release_late(f, shared, limits[0])  # noqa: E731
        try:
            done, _ = await asyncio.wait({answer}, timeout=SHARED_TIMEOUT_S)
        except asyncio.CancelledError:  # the client left while we asked
            answer.add_done_callback(give_back_if_counted)
            raise
        if not done:  # it may still count this request: give that count back when it does
            answer.add_done_callback(give_back_if_counted)
            return self._unavailable(f"no answer in {SHARED_TIMEOUT_S} s")
        try:
            incarnation, refusal = answer.result()
        except RayError as e:
            return self._unavailable(type(e).__name__)
        if refusal is not None:
            raise refusal.error()
        return Lease(limits[0], shared, incarnation)

    def _unavailable(self, why: str) -> None:
        if self._down_until <= time.monotonic():  # once per outage, not once per request
            logger.warning("shared tenant counts unavailable (%s); each tenant's "
                           "limits_fail_mode applies for %.0f s", why, RETRY_SHARED_S)
        self._down_until = time.monotonic() + RETRY_SHARED_S
        if self._factory is not None:
            self._shared = None  # look it up again next time: Ray may have replaced it
        return None

    def release(self, lease: Lease | None) -> None:
        """The leased request ended."""
        if lease is None:
            return
        if lease.shared is None:
            self._local.release(lease.tenant_id)
        else:
            lease.give_back()


def _release_late(answer: asyncio.Future, shared, tenant_id: str) -> None:
    """A late answer of the shared counts: give back the slot it counted, if any."""
    if answer.cancelled() or answer.exception() is not None:
        return
    incarnation, refusal = answer.result()
    if refusal is None:
        Lease(tenant_id, shared, incarnation).give_back()
