"""A router replica's side of the tenant limits (:mod:`serve_app.tenancy.counts`).

A router's :class:`TenantLimiter` asks the cluster's :class:`~serve_app.tenancy.ledger.Ledger`
once per request of a *limited* tenant (tenants without limits cost nothing), so a tenant
limited to 2 in flight gets 2 across all routers, and gives the slot back without waiting.
Its asks and give-backs are batched (:mod:`serve_app.tenancy.call_batcher`): one call in
flight per router, the requests that arrive meanwhile go in the next one, so the ledger's
cost per call is paid per batch.

When the ledger does not answer within :data:`SHARED_TIMEOUT_S`, the router stops asking
for :data:`RETRY_SHARED_S` and applies each tenant's ``limits_fail_mode``: ``closed``
refuses with 503 ``limits_unavailable`` and ``Retry-After``; ``open`` counts the tenant on
this router replica alone, within **its share of each limit** (the limit divided by the
router replicas running, at least 1; refilled at that share of the rate), starting from its
share of what the ledger last said remained, or, with no figure from the ledger (a router
just started, or the tenant's first request since the outage began), from its share of the
limit: never from a full budget of its own, so N routers together grant at most the limit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass

from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError
from serve_app.common.logs import get_logger
from serve_app.tenancy.call_batcher import MAX_BATCH, CallBatcher
from serve_app.tenancy.counts import REQUESTS, Limits, Quota, TenantCounts
from serve_app.tenancy.ledger import AskFailed, Ledger, ledger_for

logger = get_logger(__name__)

#: Seconds a router waits for the ledger before using the tenant's fail mode.
SHARED_TIMEOUT_S = 0.5
#: Seconds a router stops asking after the ledger did not answer.
RETRY_SHARED_S = 5.0


@dataclass(frozen=True)
class Lease:
    """One counted request: the shared counts that counted it (``shared`` None: this
    router's own counts), the tokens it reserved and the tenant's quota after it."""

    tenant_id: str
    shared: object | None = None
    incarnation: str = ""
    reserved: int = 0
    quota: Quota = Quota()


class _SharedCalls:
    """The calls to one :class:`Ledger`, batched (:class:`CallBatcher`)."""

    def __init__(self, shared: Ledger, max_batch: int = MAX_BATCH) -> None:
        self.shared = shared
        self.acquires = CallBatcher(shared.acquire_many, max_batch)
        self.releases = CallBatcher(self._release_many, max_batch)

    async def _release_many(self, releases: list[tuple]) -> list[None]:
        # Awaited so that one release call is in flight and the next batch collects; no
        # request waits for it. A settlement the ledger never got leaves the reservation
        # drawn: the tenant is charged its reservation, whatever the request cost.
        try:
            await self.shared.release_many(releases)
        except Exception as e:  # noqa: BLE001 - a ledger restarting, a Redis unreachable
            logger.warning("tenant ledger: %d settlements lost (%s: %s); their "
                           "reservations stay charged", len(releases), type(e).__name__,
                           str(e)[:200])
        return [None] * len(releases)

    def give_back(self, lease: Lease, used: int = 0) -> None:
        """Release ``lease``'s count, settling ``used`` tokens."""
        self.releases.submit((lease.tenant_id, lease.incarnation, lease.reserved, used))


class TenantLimiter:
    """A router replica's side of the tenant limits: the cluster's ledger, with a fallback.

    Args:
        shared: a :class:`Ledger`, or a factory returning one (called again after a
            failure); None counts on this router only (unit tests).
        max_batch: most asks (or give-backs) in one call to the ledger; 1 sends each in a
            call of its own (the unbatched baseline of ``scripts/bench.py --limits``).
        routers: the number of router replicas running now (for the fallback's share).
    """

    def __init__(self, shared=lambda: ledger_for(None), max_batch: int = MAX_BATCH,
                 routers: Callable[[], int] = lambda: 1) -> None:
        self._max_batch = max_batch
        self._factory = shared if callable(shared) else None
        self._calls: _SharedCalls | None = None
        self._shared = None if callable(shared) else shared
        self._local = TenantCounts()
        self._down_until = 0.0 if shared is not None else math.inf
        self._routers = routers
        self._left: dict[str, dict[str, float]] = {}  # tenant -> bucket -> the ledger's last
        self._seeded: set[str] = set()  # tenants counted locally since the ledger was lost

    @property
    def backend(self) -> str:
        return getattr(self._shared, "backend", "local")

    def use(self, factory: Callable[[], Ledger]) -> None:
        """Count in the ledger ``factory`` makes from now on (a new ``ledger:`` config)."""
        self._factory, self._shared, self._calls = factory, None, None
        self._down_until = 0.0

    def _calls_to(self, shared) -> _SharedCalls:
        if self._calls is None or self._calls.shared is not shared:
            self._calls = _SharedCalls(shared, self._max_batch)
        return self._calls

    async def start(self, timeout_s: float = 30.0) -> None:
        """Look up (or create) the shared counts and wait until they answer, so a router's
        first requests do not wait for the actor to start. On failure the first requests
        find it unavailable (their fail mode applies) and it is looked up again later."""
        if self._factory is None:
            return
        try:
            self._shared = self._factory()
            await asyncio.wait_for(self._shared.ping(), timeout_s)
            logger.info("tenant ledger: %s", self._shared.backend)
        except Exception as e:  # noqa: BLE001 - logged; acquire() handles the rest
            logger.warning("tenant ledger not ready (%s: %s)", type(e).__name__, e)

    async def acquire(self, tenant: Tenant | None, tokens: int = 0) -> Lease | None:
        """Count a new request of ``tenant`` that reserves ``tokens`` (prompt + completion,
        :mod:`serve_app.tenancy.token_budget`); None when the tenant has no limits (nothing
        to release).

        Raises:
            MeshError: 429 with ``Retry-After`` (s) and OpenAI's ``x-ratelimit-*`` headers
                when a limit is reached (``tokens_exhausted`` for a token budget); 400
                ``reservation_exceeds_budget`` when ``tokens`` exceed a whole budget; 503
                ``limits_unavailable`` with ``Retry-After`` when the shared counts do not
                answer and the tenant's ``limits_fail_mode`` is ``closed``.
        """
        if tenant is None or not Limits.of(tenant):
            return None
        limits = (tenant.id, Limits.of(tenant), tokens)
        if time.monotonic() >= self._down_until:
            lease = await self._acquire_shared(limits)
            if lease is not None:
                return lease
        if tenant.limits_fail_mode == "closed":
            raise _unavailable(f"tenant {tenant.id!r} has limits and the mesh cannot count "
                               "them right now (limits_fail_mode: closed); retry shortly")
        share = max(1, self._routers())
        local = share_of(limits[1], share)  # this router's share of each limit
        if tenant.id not in self._seeded and tenant.id in self._left:
            # This router's share of what the ledger last said remained, not a full budget.
            self._local.seed(tenant.id, local, {
                name: level / share if level > 0 else level
                for name, level in self._left[tenant.id].items()})
        self._seeded.add(tenant.id)
        refusal, quota = self._local.acquire(tenant.id, local, tokens)
        if refusal is not None and refusal.code == "reservation_exceeds_budget" and all(
                tokens <= limit for name, limit in limits[1].buckets().items()
                if name != REQUESTS):
            # More than this router's share, not more than the budget: the outage's fault.
            raise _unavailable(f"the request reserves {tokens} tokens, more than this router "
                               f"may grant tenant {tenant.id!r} alone ({share} routers share "
                               "its budget) while the mesh cannot count its limits; retry "
                               "shortly, or set a smaller max_tokens")
        if refusal is not None:
            raise refusal.error()
        return Lease(tenant.id, reserved=tokens, quota=quota)

    async def _acquire_shared(self, limits: tuple) -> Lease | None:
        """Ask the shared counts; None when they cannot answer in time (raises the 429)."""
        try:
            if self._shared is None:
                self._shared = self._factory()
            shared = self._shared
            calls = self._calls_to(shared)
            answer = calls.acquires.submit(limits)
        except Exception as e:  # noqa: BLE001 - no actor to ask: the fail mode decides
            return self._unavailable(type(e).__name__)
        give_back_if_counted = lambda f: _release_late(f, calls, limits)  # noqa: E731
        try:
            done, _ = await asyncio.wait({answer}, timeout=SHARED_TIMEOUT_S)
        except asyncio.CancelledError:  # the client left while we asked
            answer.add_done_callback(give_back_if_counted)
            raise
        if not done:  # it may still count this request: give that count back when it does
            answer.add_done_callback(give_back_if_counted)
            return self._unavailable(f"no answer in {SHARED_TIMEOUT_S} s")
        try:
            incarnation, refusal, quota = answer.result()
        except AskFailed as e:  # the ledger answers, but could not count this tenant now
            logger.warning("tenant ledger could not count tenant %r (%s); its "
                           "limits_fail_mode applies to this request", limits[0], e)
            return None
        except Exception as e:  # noqa: BLE001 - a dead actor, or one that cannot answer this
            return self._unavailable(f"{type(e).__name__}: {e}"[:200])
        self._left[limits[0]] = dict(quota.left)
        self._seeded.clear()  # the ledger answers: a later outage starts from its figures
        if refusal is not None:
            raise refusal.error()
        return Lease(limits[0], shared, incarnation, limits[2], quota)

    def _unavailable(self, why: str) -> None:
        if self._down_until <= time.monotonic():  # once per outage, not once per request
            logger.warning("shared tenant counts unavailable (%s); each tenant's "
                           "limits_fail_mode applies for %.0f s", why, RETRY_SHARED_S)
        self._down_until = time.monotonic() + RETRY_SHARED_S
        if self._factory is not None:
            self._shared = None  # look it up again next time: Ray may have replaced it
        return None

    def release(self, lease: Lease | None, used: int = 0) -> None:
        """The leased request ended, having cost ``used`` tokens."""
        if lease is None:
            return
        if lease.shared is None:
            self._local.release(lease.tenant_id, lease.reserved, used)
        else:
            self._calls_to(lease.shared).give_back(lease, used)


def share_of(limits: Limits, routers: int) -> Limits:
    """What one of ``routers`` router replicas may grant alone: each limit of ``limits``
    divided by ``routers``, rounded down, at least 1."""
    return Limits(*(None if v is None else max(1, v // routers) for v in astuple(limits)))


def _unavailable(message: str) -> MeshError:
    """503 ``limits_unavailable`` with ``Retry-After``: the shared counts do not answer."""
    return MeshError(503, message, code="limits_unavailable",
                     headers={"Retry-After": str(math.ceil(RETRY_SHARED_S))})


def _release_late(answer: asyncio.Future, calls: _SharedCalls, limits: tuple) -> None:
    """A late answer of the shared counts: give back the slot and tokens it counted, if
    any (the request did not run on them)."""
    if answer.cancelled() or answer.exception() is not None:
        return
    incarnation, refusal, _ = answer.result()
    if refusal is None:
        calls.give_back(Lease(limits[0], calls.shared, incarnation, limits[2]), 0)
