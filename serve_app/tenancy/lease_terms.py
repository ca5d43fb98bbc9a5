"""Budget leases, the terms both sides keep: a router replica's :class:`Renewal`, the ledger's
:class:`Grant`, the ledger's record of one lease (:class:`Hold`), and their timing.

A budget lease is a slice of one tenant's budget that the ledger
(:mod:`serve_app.tenancy.ledger`) sets aside for one router replica: **credit** in each of the
tenant's buckets (tokens, or requests for ``requests_per_minute``). The router spends it on
requests with no ledger call (:mod:`serve_app.tenancy.lease_keeper`) and renews it about every
:data:`RENEW_S`. A tenant with ``max_concurrent_requests`` is never leased (a slot lent to one
router and idle there would refuse another router's request below the limit): each of its
requests asks the ledger.

Credit stays in the tenant's bucket while a lease holds it: the bucket's level counts what
is held, and only the rest is free to other asks and leases. Held plus free never exceed the
limit, so every grant, lease or not, is drawn from one token bucket, and a tenant gets at most
its limit plus one window's refill across all routers (the same bound as without leases).

A renewal reports what the router spent, **cumulative** since the lease opened (net of its
requests' settlements, so an ending's ``reserved - used`` comes back through it): a renewal
applied twice, or one whose answer was lost, counts nothing twice. Its ``seq`` orders them;
the ledger answers a repeated one with the lease as it stands. While a renewal is in flight
the router goes on spending at most ``keep``, which the ledger never takes back: if the
answer is lost, the router stays within what the ledger holds for it either way.

A lease the ledger hears nothing of for :data:`BUDGET_LEASE_TTL_S` (its router replica
died) expires: its unspent credit is counted as spent (the router may have spent it
without reporting it: nothing is given back that may have been used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from serve_app.tenancy.quota import Limits, Quota

#: Seconds between a router's renewals of its leases while a tenant is active. Each renewal
#: is one ledger call per router replica for all its tenants, whatever their requests/s;
#: a slice sized for about this long is small against a 60 s window (a minute's limit / 60
#: per router), and idle credit goes back within about this long.
RENEW_S = 1.0
#: Seconds a lease lives at the ledger after its last renewal. Ten renewals can be missed
#: (a slow ledger, a paused process) before it expires; and it is well below the shortest
#: window (60 s), so a router replica that dies (kill -9) holds nothing past it.
BUDGET_LEASE_TTL_S = 10.0
#: Retry-After (s) at least, of a refusal while leases hold credit of that tenant: an idle
#: lease gives it back at its router's next renewal after one interval without requests,
#: within two renewals (plus a second for the call).
LEASE_RETRY_AFTER_S = math.ceil(2 * RENEW_S) + 1


@dataclass(frozen=True)
class Renewal:
    """A router's report and ask for its lease ``lease_id`` on tenant ``tenant_id``.

    Attributes:
        seq: 1 for a new lease, then one more per renewal sent.
        limits: the tenant's limits now (as an ask carries them).
        spent: per bucket, what the router spent from this lease since it opened, net of
            settlements (tokens, or requests), cumulative.
        keep: per bucket, credit the router goes on spending while this renewal is in
            flight (at most what it holds unspent): the ledger leaves it.
        want: per bucket, credit wanted for the next interval (from demand).
        least: per bucket, the smallest credit worth holding (a couple of requests'
            reservations): the ledger grants no fresh credit below it.
        in_flight: requests in flight on this lease: the ledger keeps a lease with any, even
            with no credit, so their settlements come back through it.
        pending: per bucket, what this router's asks of this tenant now on their way to the
            ledger draw (requests its lease did not cover): left free for them, so a fresh
            slice does not refuse them.
        routers: router replicas running now; a grant is at most this router's share of
            what is left.
    """

    tenant_id: str
    lease_id: str
    seq: int
    limits: Limits
    spent: dict[str, float] = field(default_factory=dict)
    keep: dict[str, float] = field(default_factory=dict)
    want: dict[str, float] = field(default_factory=dict)
    least: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    pending: dict[str, float] = field(default_factory=dict)
    routers: int = 1

    @property
    def closing(self) -> bool:
        """The router gives the whole lease back (idle, nothing in flight on it)."""
        return not any(self.want.values()) and self.in_flight == 0


@dataclass(frozen=True)
class Grant:
    """The ledger's answer to a :class:`Renewal`.

    Attributes:
        held: False when the ledger holds no such lease (closed, or expired: the router
            drops it and counts on the ledger until it opens a new one).
        credit: per bucket, what the router may spend beyond the ``spent`` it reported.
        quota: the tenant's quota after the grant; its remaining figures are what is free
            beyond every lease's credit.
    """

    lease_id: str
    seq: int
    held: bool
    credit: dict[str, float] = field(default_factory=dict)
    quota: Quota | None = None


@dataclass
class Hold:
    """The ledger's record of one lease: its unspent ``credit`` per bucket, the cumulative
    ``spent`` last reported, the last ``seq`` applied, and when it expires (``until``, the
    ledger's clock, s)."""

    credit: dict[str, float] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)
    seq: int = 0
    until: float = 0.0

    def state(self) -> dict[str, Any]:
        return {"credit": self.credit, "spent": self.spent, "seq": self.seq,
                "until": self.until}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Hold:
        return cls(dict(state["credit"]), dict(state["spent"]), int(state["seq"]),
                   float(state["until"]))

    def credit_in(self, bucket: str) -> float:
        """Unspent credit in ``bucket`` (a lease that overspent holds none)."""
        return max(0.0, self.credit.get(bucket, 0.0))


def share(free: float, routers: int) -> float:
    """One router's share of ``free`` credit among ``routers`` (0 when none is free)."""
    return max(0.0, free) / max(1, routers)
