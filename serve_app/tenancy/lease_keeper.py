"""A router replica's budget leases: each busy tenant's slice of its limits, spent here with no
ledger call per request (the terms: :mod:`serve_app.tenancy.lease_terms`).

:class:`LeaseKeeper` watches the demand on this router of each tenant whose limits are
buckets only (a tenant with ``max_concurrent_requests`` is never leased:
:mod:`serve_app.tenancy.limits`). A tenant with at least :data:`LEASE_MIN_REQUESTS` requests
in an interval gets a lease: credit in each of its buckets, sized by demand (what this router
drew over the last interval, per :data:`RENEW_S`, times :data:`DEMAND_FACTOR`), at most this
router's share of what the tenant has free. A request the lease covers takes its reservation
from it; its settlement goes back to it, or is a debt on it, and reaches the ledger with the
next renewal. A request it cannot cover (no lease yet, too little credit left) is asked of the
ledger as without leases, and a lease that ran dry is renewed at once. Every :data:`RENEW_S`,
one call renews the leases of all tenants: each reports its spending, gives back what its
demand does not need and takes a new slice; a lease idle for an interval, with nothing in
flight on it, is given back whole.

A lease that cannot be renewed (the ledger down) is still spent until its local deadline, a
little before the ledger would expire it; then the tenant's ``limits_fail_mode`` applies,
as to any request the ledger does not answer.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from serve_app.common.logs import get_logger
from serve_app.common.shared_task import start_shared_task
from serve_app.tenancy.lease_terms import BUDGET_LEASE_TTL_S, RENEW_S, Grant, Renewal
from serve_app.tenancy.quota import REQUESTS, Limits, Quota, draw

logger = get_logger(__name__)

#: Requests of a tenant in one interval on this router before it gets a lease: fewer cost
#: the ledger less without one (a lease costs a renewal a second, and its give-back).
LEASE_MIN_REQUESTS = 4
#: A slice covers this many times the last interval's draws: room for the demand to double
#: before the next renewal, and a lease that runs dry before it is renewed at once.
DEMAND_FACTOR = 2.0
#: No fresh credit below this many of the interval's largest reservations: a slice that
#: cannot serve two requests only keeps budget from the other routers.
LEAST_REQUESTS = 2
#: A lease is spent here until this many seconds before the ledger would expire it
#: (clocks, and a renewal's time on the way), counted from the last renewal that answered.
EXPIRY_MARGIN_S = 2.0
#: Seconds a renewal call may take before it counts as failed (the lease goes on, frozen at
#: what it keeps, until one answers).
RENEW_TIMEOUT_S = 2.0 * RENEW_S
#: Seconds at least between renewals of one tenant, a lease that ran dry included.
MIN_RENEW_GAP_S = 0.1 * RENEW_S


@dataclass
class Demand:
    """One tenant's requests on this router since its lease was last renewed: how many, what
    they drew per bucket (reservations, before settlement), and the largest draw per
    bucket."""

    since: float
    requests: int = 0
    drawn: dict[str, float] = field(default_factory=dict)
    largest: dict[str, float] = field(default_factory=dict)

    def add(self, limits: Limits, tokens: int) -> None:
        self.requests += 1
        for name in limits.buckets():
            d = draw(name, tokens)
            self.drawn[name] = self.drawn.get(name, 0.0) + d
            self.largest[name] = max(self.largest.get(name, 0.0), d)


class BudgetLease:
    """This router's lease on one tenant's budget (one lease id; a new one after a lease is
    given back or lost).

    ``spent`` (per bucket, cumulative since the lease opened, net of settlements) may grow up
    to ``cap`` (the ledger's credit plus what was spent when it granted it); ``in_flight``
    requests counted on it have not ended yet.
    """

    def __init__(self, tenant_id: str, lease_id: str) -> None:
        self.tenant_id, self.id = tenant_id, lease_id
        self.seq = 0
        self.spent: dict[str, float] = {}
        self.cap: dict[str, float] = {}
        self.in_flight = 0
        self.deadline = -math.inf  # local clock; none granted yet
        self.renewing = False
        self.last_sent = -math.inf
        self._quota: Quota | None = None

    def left(self, bucket: str) -> float:
        """Credit left in ``bucket`` now (negative: a debt)."""
        return self.cap.get(bucket, 0.0) - self.spent.get(bucket, 0.0)

    def covers(self, limits: Limits, tokens: int, now: float) -> bool:
        """Whether a request of ``tokens`` fits: the lease is live and has credit in each
        of the tenant's buckets."""
        if now >= self.deadline:
            return False
        return all(name in self.cap and self.spent.get(name, 0.0) + draw(name, tokens)
                   <= self.cap[name] for name in limits.buckets())

    def take(self, limits: Limits, tokens: int) -> None:
        """Count a request of ``tokens`` on the lease (after :meth:`covers`)."""
        self.in_flight += 1
        for name in limits.buckets():
            self.spent[name] = self.spent.get(name, 0.0) + draw(name, tokens)

    def settle(self, reserved: int, used: int) -> None:
        """A request of the lease ended, having cost ``used`` of its ``reserved`` tokens:
        the rest goes back to the lease, an excess is spent from it (a debt if it has no
        credit left). Its request stays counted in ``requests_per_minute``."""
        self.in_flight = max(0, self.in_flight - 1)
        for name in self.spent:
            if name != REQUESTS:
                self.spent[name] += used - reserved

    def quota(self) -> Quota:
        """The tenant's quota for the response headers: what was free at the ledger at the
        last grant, plus what this lease has left now."""
        q = self._quota or Quota()
        left = dict(q.left)

        def figures(name: str, at_grant: tuple[int, int, float] | None):
            if at_grant is None or name not in left:
                return at_grant
            return at_grant[0], max(0, int(left[name] + self.left(name))), at_grant[2]
        tokens = "tokens_per_minute" if "tokens_per_minute" in left else "tokens_per_day"
        return Quota(figures(REQUESTS, q.requests), figures(tokens, q.tokens), q.left)

    def heard(self, quota: Quota) -> None:
        """The ledger's figures, newer than the last grant's (what is free beyond leases)."""
        self._quota = quota

    def renewal(self, limits: Limits, demand: Demand | None, routers: int, now: float,
                idle: bool, pending: Demand | None = None) -> Renewal:
        """The next :class:`Renewal`: demand-sized wants, the whole lease given back when
        ``idle`` and nothing is in flight on it. From now until the answer, the lease spends
        at most what it keeps."""
        self.seq += 1
        self.renewing, self.last_sent = True, now
        scale = 0.0
        if demand is not None and demand.requests:
            scale = RENEW_S / max(now - demand.since, MIN_RENEW_GAP_S) * DEMAND_FACTOR
        buckets = limits.buckets()
        want = {} if idle else {name: math.ceil(demand.drawn.get(name, 0.0) * scale)
                                for name in buckets} if demand else {}
        keep = {name: min(max(0.0, self.left(name)), want.get(name, 0.0)) for name in buckets}
        for name in buckets:  # frozen at what the ledger will leave, whatever it answers
            self.cap[name] = self.spent.get(name, 0.0) + keep[name]
        least = {name: LEAST_REQUESTS * demand.largest.get(name, 0.0)
                 for name in buckets} if demand else {}
        return Renewal(self.tenant_id, self.id, self.seq, limits, dict(self.spent), keep,
                       want, least, self.in_flight, dict(pending.drawn) if pending else {},
                       routers)

    def renewed(self, r: Renewal, grant: Grant, sent_at: float) -> None:
        """The ledger's answer to ``r`` (sent at ``sent_at``, local clock)."""
        self.renewing = False
        if grant.seq != r.seq:
            return
        self.cap = {name: r.spent.get(name, 0.0) + credit
                    for name, credit in grant.credit.items()}
        self.deadline = sent_at + BUDGET_LEASE_TTL_S - EXPIRY_MARGIN_S
        self._quota = grant.quota

    def failed(self) -> None:
        """No answer: the lease stays frozen at what it kept, until one comes."""
        self.renewing = False


def supports_leases(ledger: object) -> bool:
    """Whether ``ledger`` grants budget leases (test doubles of the ledger may not)."""
    return callable(getattr(ledger, "renew_many", None))


class LeaseKeeper:
    """One router replica's :class:`BudgetLease` per busy tenant, and their renewals.

    Args:
        ledger: returns the :class:`~serve_app.tenancy.ledger_protocol.Ledger` to renew with now
            (None: none reachable; the leases go on until their deadline).
        routers: the number of router replicas running now.
        heard: called with ``(tenant_id, quota)`` for each answer of the ledger (the
            limiter's last figures, for its fail mode).
        clock: ``time.monotonic`` (tests pass a fake).
        background: renew in a background task; False: only when :meth:`renew` is called
            (tests on a fake clock).
    """

    def __init__(self, ledger: Callable[[], object | None], routers: Callable[[], int],
                 heard: Callable[[str, Quota], None] = lambda tenant_id, quota: None,
                 clock: Callable[[], float] = time.monotonic, background: bool = True
                 ) -> None:
        self._ledger, self._routers, self._heard, self._clock = ledger, routers, heard, clock
        self._background = background
        self._id = uuid.uuid4().hex[:12]
        self._numbers = itertools.count(1)
        self.leases: dict[str, BudgetLease] = {}
        self._demand: dict[str, Demand] = {}
        self._limits: dict[str, Limits] = {}
        self._asking: dict[str, Demand] = {}  # asks on their way to the ledger, per tenant
        self._due: set[str] = set()  # tenants to renew at once (a lease ran dry, or a new one)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def take(self, tenant_id: str, limits: Limits, tokens: int) -> BudgetLease | None:
        """Count a request of ``tenant_id`` reserving ``tokens`` on its lease; None when the
        lease cannot cover it: the caller asks the ledger, and calls :meth:`asked` once it
        has its answer. Either way it counts as demand."""
        now = self._clock()
        self._limits[tenant_id] = limits
        demand = self._demand.setdefault(tenant_id, Demand(now))
        demand.add(limits, tokens)
        lease = self.leases.get(tenant_id)
        if lease is not None and lease.covers(limits, tokens, now):
            lease.take(limits, tokens)
            return lease
        if (demand.requests >= LEASE_MIN_REQUESTS and (lease is None or not lease.renewing)
                and now - (lease.last_sent if lease else -math.inf) >= MIN_RENEW_GAP_S):
            self._due.add(tenant_id)  # a busy tenant with no lease, or one that ran dry
        self._asking.setdefault(tenant_id, Demand(now)).add(limits, tokens)
        self._run()
        return None

    def asked(self, tenant_id: str, limits: Limits, tokens: int) -> None:
        """A request :meth:`take` did not cover has its answer (from the ledger, or from this
        router's fail-open counts): it no longer waits on the ledger's free budget."""
        asking = self._asking.get(tenant_id)
        if asking is not None:
            asking.requests -= 1
            for name in asking.drawn:
                asking.drawn[name] -= draw(name, tokens)
            if asking.requests <= 0:
                del self._asking[tenant_id]

    def ended(self, lease: BudgetLease, reserved: int, used: int) -> None:
        """A request counted on ``lease`` ended, having cost ``used`` of its ``reserved``
        tokens."""
        if self.leases.get(lease.tenant_id) is lease:
            lease.settle(reserved, used)
        # A lease since lost: the ledger counted its whole credit spent when it expired.

    def heard(self, tenant_id: str, quota: Quota) -> None:
        """The ledger's latest figures for ``tenant_id`` (an asked request's answer, or a
        grant): the response headers of the requests its lease covers start from them, so
        what was asked of the ledger since the last renewal shows at once."""
        if (lease := self.leases.get(tenant_id)) is not None:
            lease.heard(quota)

    def forget(self) -> None:
        """Drop every lease (a new ledger): the old ledger expires them, counted spent."""
        if self.leases:
            logger.info("tenant ledger changed: %d budget leases left to expire at the old "
                        "one", len(self.leases))
        self.leases.clear()
        self._demand.clear()
        self._asking.clear()
        self._due.clear()

    def _run(self) -> None:
        if not self._background:
            return
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._due:
            self._wake.set()
        if self._task is None or self._task.done():
            self._task = start_shared_task(self._renewals())

    async def _renewals(self) -> None:
        """Renew every :data:`RENEW_S` while any tenant is active; at once for those due."""
        next_tick = self._clock() + RENEW_S
        while self.leases or self._demand:
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_tick - self._clock()))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            tick = self._clock() >= next_tick
            if tick:
                next_tick = self._clock() + RENEW_S
            try:
                await self.renew(None if tick else set(self._due))
            except Exception:  # noqa: BLE001 - the loop must go on; logged
                logger.exception("budget lease renewal failed")

    async def renew(self, only: set[str] | None = None) -> None:
        """One renewal call for every active tenant (``only``: those tenants)."""
        now = self._clock()
        ledger = self._ledger()
        if ledger is None:
            return  # none reachable now: the leases go on until their deadline
        if not supports_leases(ledger):
            self._demand.clear()
            return
        sent: list[tuple[BudgetLease, Renewal]] = []
        for tenant_id in list(self._demand.keys() | self.leases.keys()):
            if only is not None and tenant_id not in only:
                continue
            self._due.discard(tenant_id)
            lease = self.leases.get(tenant_id)
            if lease is not None and (lease.renewing or (
                    tenant_id not in self._demand and now - lease.last_sent < RENEW_S / 2)):
                continue  # in flight, or renewed a moment ago
            demand = self._demand.pop(tenant_id, None)
            if lease is None:
                if demand is None or demand.requests < LEASE_MIN_REQUESTS:
                    continue
                lease = self.leases[tenant_id] = BudgetLease(
                    tenant_id, f"{self._id}-{next(self._numbers)}")
            idle = demand is None  # no request since its last renewal, half a second ago
            sent.append((lease, lease.renewal(self._limits[tenant_id], demand,
                                              max(1, self._routers()), now, idle,
                                              self._asking.get(tenant_id))))
        if not sent:
            return
        try:
            grants = await asyncio.wait_for(ledger.renew_many([r for _, r in sent]),
                                            RENEW_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a ledger down: leases go on, frozen
            logger.warning("budget leases of %d tenants not renewed (%s: %s); each is spent "
                           "until its deadline", len(sent), type(e).__name__, str(e)[:200])
            for lease, _ in sent:
                lease.failed()
            return
        for (lease, r), grant in zip(sent, grants):
            if isinstance(grant, BaseException):
                lease.failed()
                continue
            if grant.quota is not None:
                self._heard(lease.tenant_id, grant.quota)
            if grant.held:
                lease.renewed(r, grant, now)
            else:  # given back, or lost: requests ask the ledger until a new one opens
                lease.failed()
                if self.leases.get(lease.tenant_id) is lease:
                    del self.leases[lease.tenant_id]
