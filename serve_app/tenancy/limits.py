"""A router replica's side of the tenant limits (:mod:`serve_app.tenancy.counts`).

Tenants without limits cost nothing. A request of a *limited* tenant is counted, in order:

1. on this router's **budget lease** on the tenant's budget, with no ledger call, when the
   tenant is busy enough to hold one, has no ``max_concurrent_requests`` (a slot is never
   lent) and the lease covers the request (:mod:`serve_app.tenancy.lease_keeper`; off with
   ``ledger.leases: false``);
2. else by the cluster's :class:`~serve_app.tenancy.ledger_protocol.Ledger`, asked for this request
   (and settled at its end): so a tenant limited to 2 in flight gets 2 across all routers.
   Asks and give-backs are batched (:mod:`serve_app.tenancy.call_batcher`): one call in
   flight per router, the requests that arrive meanwhile go in the next one, so the
   ledger's cost per call is paid per batch.

Either way the tenant gets at most its limit plus one window's refill across all routers.

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
from serve_app.tenancy.counts import TenantCounts
from serve_app.tenancy.lease_keeper import BudgetLease, LeaseKeeper
from serve_app.tenancy.ledger import ledger_for
from serve_app.tenancy.ledger_protocol import AskFailed, Ledger
from serve_app.tenancy.quota import REQUESTS, Limits, Quota

logger = get_logger(__name__)

#: Seconds a router waits for the ledger before using the tenant's fail mode.
SHARED_TIMEOUT_S = 0.5
#: Seconds a router stops asking after the ledger did not answer.
RETRY_SHARED_S = 5.0


@dataclass(frozen=True)
class CountedRequest:
    """One counted request: where it was counted (``lease``: this router's budget lease;
    else ``shared``, the ledger, under ``incarnation``; neither: this router's own counts),
    the tokens it reserved and the tenant's quota after it."""

    tenant_id: str
    shared: object | None = None
    incarnation: str = ""
    reserved: int = 0
    quota: Quota = Quota()
    lease: BudgetLease | None = None


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

    def give_back(self, counted: CountedRequest, used: int = 0) -> None:
        """Release ``counted``'s count, settling ``used`` tokens."""
        self.releases.submit((counted.tenant_id, counted.incarnation, counted.reserved, used))


class TenantLimiter:
    """A router replica's side of the tenant limits: the cluster's ledger, with a fallback.

    Args:
        shared: a :class:`Ledger`, or a factory returning one (called again after a
            failure); None counts on this router only (unit tests).
        max_batch: most asks (or give-backs) in one call to the ledger; 1 sends each in a
            call of its own (the unbatched baseline of ``scripts/bench.py --limits``).
        routers: the number of router replicas running now (for the fallback's share, and
            a lease's).
        leases: hold budget leases on busy tenants (when the ledger grants them).
        clock: seconds now (``time.monotonic`` by default): when the pause of
            :data:`RETRY_SHARED_S` after a ledger that did not answer ends, and the leases'
            (:class:`LeaseKeeper`); tests pass a fake.
        renew_in_background: the leases' (tests on a fake clock renew by hand).
    """

    def __init__(self, shared=lambda: ledger_for(None), max_batch: int = MAX_BATCH,
                 routers: Callable[[], int] = lambda: 1, leases: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 renew_in_background: bool = True) -> None:
        self._max_batch = max_batch
        self._clock = clock
        self._factory = shared if callable(shared) else None
        self._calls: _SharedCalls | None = None
        self._shared = None if callable(shared) else shared
        self._local = TenantCounts()
        self._down_until = 0.0 if shared is not None else math.inf
        self._routers = routers
        self._left: dict[str, dict[str, float]] = {}  # tenant -> bucket -> the ledger's last
        self._seeded: set[str] = set()  # tenants counted locally since the ledger was lost
        self.leases = LeaseKeeper(lambda: self._shared, routers, self._heard, clock,
                                  renew_in_background)
        self._leasing = leases and shared is not None

    def _heard(self, tenant_id: str, quota: Quota) -> None:
        """The ledger's figures for ``tenant_id``: a later outage starts from them."""
        self._left[tenant_id] = dict(quota.left)
        self._seeded.clear()
        self.leases.heard(tenant_id, quota)

    @property
    def backend(self) -> str:
        return getattr(self._shared, "backend", "local")

    def use(self, factory: Callable[[], Ledger], leases: bool = True) -> None:
        """Count in the ledger ``factory`` makes from now on (a new ``ledger:`` config),
        with budget leases or not."""
        self._factory, self._shared, self._calls = factory, None, None
        self._down_until = 0.0
        self.leases.forget()
        self._leasing = leases

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

    async def acquire(self, tenant: Tenant | None, tokens: int = 0) -> CountedRequest | None:
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
        # A concurrency limit is never leased: a slot lent to one router and idle there would
        # refuse another router's request below the limit. Such a tenant's every request
        # asks the ledger (it needs a slot there anyway, and the ask draws its tokens too).
        leased = self._leasing and not limits[1].max_concurrent_requests
        if leased:  # a lease is spent until its deadline, the ledger down or not
            lease = self.leases.take(*limits)
            if lease is not None:
                return CountedRequest(tenant.id, reserved=tokens, quota=lease.quota(),
                                      lease=lease)
        try:
            return await self._acquire_unleased(tenant, limits)
        finally:
            if leased:
                self.leases.asked(*limits)

    async def _acquire_unleased(self, tenant: Tenant, limits: tuple) -> CountedRequest:
        """Count the request with the ledger, or by the tenant's fail mode (see
        :meth:`acquire`)."""
        tokens = limits[2]
        if self._clock() >= self._down_until:
            counted = await self._acquire_shared(limits)
            if counted is not None:
                return counted
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
        return CountedRequest(tenant.id, reserved=tokens, quota=quota)

    async def _acquire_shared(self, limits: tuple) -> CountedRequest | None:
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
        self._heard(limits[0], quota)  # the ledger answers: a later outage starts from it
        if refusal is not None:
            raise refusal.error()
        return CountedRequest(limits[0], shared, incarnation, limits[2], quota)

    def _unavailable(self, why: str) -> None:
        if self._down_until <= self._clock():  # once per outage, not once per request
            logger.warning("shared tenant counts unavailable (%s); each tenant's "
                           "limits_fail_mode applies for %.0f s", why, RETRY_SHARED_S)
        self._down_until = self._clock() + RETRY_SHARED_S
        if self._factory is not None:
            self._shared = None  # look it up again next time: Ray may have replaced it
        return None

    def release(self, counted: CountedRequest | None, used: int = 0) -> None:
        """The counted request ended, having cost ``used`` tokens: settled on its lease, or
        with the ledger (in the background), or here."""
        if counted is None:
            return
        if counted.lease is not None:
            self.leases.ended(counted.lease, counted.reserved, used)
        elif counted.shared is None:
            self._local.release(counted.tenant_id, counted.reserved, used)
        else:
            self._calls_to(counted.shared).give_back(counted, used)


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
        calls.give_back(CountedRequest(limits[0], calls.shared, incarnation, limits[2]), 0)
