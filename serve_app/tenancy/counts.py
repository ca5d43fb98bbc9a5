"""Per-tenant limits on requests and tokens, counted: pure, no I/O, no clock of its own.

- ``max_concurrent_requests``: requests in flight (a stream counts until it ends).
- ``requests_per_minute``: a bucket holding ``rpm`` requests, refilled at ``rpm / 60`` per
  second (the usual token-bucket rate limiter).
- ``tokens_per_minute``, ``tokens_per_day``: buckets of prompt + completion tokens, drawn by
  a reservation at admission and settled with the real usage when the request ends
  (:mod:`serve_app.tenancy.token_budget`). Over budget: 429 ``tokens_exhausted``.

Every answer to a limited tenant carries OpenAI's ``x-ratelimit-*`` headers (:class:`Quota`).
:class:`TenantCounts` is what every ledger backend (:mod:`serve_app.tenancy.ledger`) runs;
:meth:`TenantCounts.export` and :meth:`TenantCounts.load` are how a backend keeps it.

Router replicas' budget leases (:mod:`serve_app.tenancy.lease_terms`) are counted here too:
a lease's credit stays in its bucket's level and is not free to anyone else
(:meth:`TenantCounts.renew`). A lease holds credit only, never a slot of
``max_concurrent_requests``: such a tenant's requests are each counted here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from serve_app.common.errors import MeshError
from serve_app.tenancy.lease_terms import (BUDGET_LEASE_TTL_S, LEASE_RETRY_AFTER_S, Grant,
                                           Hold, Renewal, share)
from serve_app.tenancy.quota import BUCKET_WINDOWS_S, REQUESTS, Limits, Quota, draw
from serve_app.tenancy.token_budget import TokenBucket


@dataclass
class _TenantState:
    in_flight: int = 0
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)  # lease id -> its budget lease

    def held(self, bucket: str, but: str = "") -> float:
        """Credit every lease (but ``but``) holds in ``bucket``."""
        return sum(h.credit_in(bucket) for lease, h in self.holds.items() if lease != but)

    def free(self, name: str) -> float:
        """What ``name``'s bucket has beyond the leases' credit (refilled by the caller)."""
        return self.buckets[name].level - self.held(name)

    def expire(self, now: float) -> None:
        """Drop the leases not renewed in time: their unspent credit is counted as spent
        (their router may have spent it unreported)."""
        for lease, hold in list(self.holds.items()):
            if hold.until <= now:
                for name, bucket in self.buckets.items():
                    bucket.refill(now)
                    bucket.level -= hold.credit_in(name)
                del self.holds[lease]


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the fields of a :class:`MeshError` (picklable).
    ``retry_after_s`` None: retrying the same request cannot succeed."""

    status: int
    message: str
    code: str
    retry_after_s: int | None
    quota: Quota = Quota()

    def error(self) -> MeshError:
        headers = self.quota.headers()
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return MeshError(self.status, self.message, code=self.code, headers=headers)


class TenantCounts:
    """In-flight counts and token buckets (requests and tokens) per tenant id; no I/O.

    Args:
        clock: ``time.monotonic`` (tests pass a fake).
    """

    def __init__(self, clock=time.monotonic) -> None:
        self._state: dict[str, _TenantState] = {}
        self._clock = clock

    def _tenant(self, tenant_id: str, limits: Limits, now: float) -> _TenantState:
        """The tenant's state, its buckets matched to ``limits`` (a config change keeps
        what was left, up to the new limit)."""
        st = self._state.setdefault(tenant_id, _TenantState())
        st.expire(now)
        wanted = limits.buckets()
        for name in list(st.buckets):
            if name not in wanted:
                del st.buckets[name]
        for name, limit in wanted.items():
            old = st.buckets.get(name)
            if old is None or old.limit != limit:
                st.buckets[name] = bucket = TokenBucket(limit, BUCKET_WINDOWS_S[name], now)
                if old is not None:
                    old.refill(now)
                    bucket.level = min(float(limit), old.level)
        return st

    def acquire(self, tenant_id: str, limits: Limits, tokens: int = 0
                ) -> tuple[Refusal | None, Quota]:
        """Count a new request that reserves ``tokens`` (prompt + completion); returns the
        :class:`Refusal` (429 at a limit, 400 when ``tokens`` exceed a whole budget) or
        None, and the tenant's :class:`Quota` after the decision."""
        now = self._clock()
        st = self._tenant(tenant_id, limits, now)
        refusal = self._refusal(tenant_id, st, limits, tokens, now)
        if refusal is None:
            for name, bucket in st.buckets.items():
                bucket.take(draw(name, tokens))
            st.in_flight += 1
        quota = self._quota(st, now)
        return (replace(refusal, quota=quota) if refusal else None), quota

    @staticmethod
    def _refusal(tenant_id: str, st: _TenantState, limits: Limits, tokens: int,
                 now: float) -> Refusal | None:
        if (limits.max_concurrent_requests
                and st.in_flight >= limits.max_concurrent_requests):
            return Refusal(429, f"tenant {tenant_id!r} has {st.in_flight} requests in flight;"
                           f" the limit is {limits.max_concurrent_requests}",
                           "concurrency_limit_exceeded", 1)
        for name, bucket in st.buckets.items():
            wait_s = bucket.wait_s(draw(name, tokens), now)
            held = st.held(name)
            if held and not math.isinf(wait_s) and bucket.level - held < draw(name, tokens):
                # Leases hold some of it: they give back what they do not spend.
                wait_s = max(wait_s, LEASE_RETRY_AFTER_S)
            if wait_s == 0:
                continue
            if name == REQUESTS:
                return Refusal(429, f"tenant {tenant_id!r} is over its limit of "
                               f"{bucket.limit} requests per minute", "rate_limit_exceeded",
                               math.ceil(wait_s))
            if math.isinf(wait_s):
                return Refusal(400, f"the request reserves {tokens} tokens (prompt bound "
                               "plus what vLLM may generate for it: max_tokens x n per "
                               "prompt; unset, the rest of the context), more than "
                               f"tenant {tenant_id!r}'s whole {name} of {bucket.limit}; set a "
                               "smaller max_tokens", "reservation_exceeds_budget", None)
            free = bucket.level - held
            left = (f"has {int(free)} of its {name} {bucket.limit} left"
                    if free >= 0 else f"owes {math.ceil(-free)} tokens of its "
                    f"{name} {bucket.limit} (its requests cost more than they reserved)")
            return Refusal(429, f"tenant {tenant_id!r} {left} and this request reserves "
                           f"{tokens}; retry in {math.ceil(wait_s)} s or set a smaller "
                           "max_tokens", "tokens_exhausted", math.ceil(wait_s))
        return None

    def quota(self, tenant_id: str, limits: Limits) -> Quota:
        """The tenant's :class:`Quota` now, counting nothing."""
        now = self._clock()
        return self._quota(self._tenant(tenant_id, limits, now), now)

    @staticmethod
    def _quota(st: _TenantState, now: float) -> Quota:
        """Remaining: what is free beyond the leases' credit."""
        def figures(name: str) -> tuple[int, int, float] | None:
            b = st.buckets.get(name)
            return None if b is None else (b.limit, max(0, int(st.free(name))),
                                           b.reset_s(now))
        return Quota(requests=figures(REQUESTS),
                     tokens=figures("tokens_per_minute") or figures("tokens_per_day"),
                     left=tuple((name, st.free(name)) for name in st.buckets))

    def release(self, tenant_id: str, reserved: int = 0, used: int = 0, *,
                counted: bool = True) -> None:
        """A request ended, having cost ``used`` of the ``reserved`` tokens. ``counted``
        False: its in-flight count is not held here any more (the ledger restarted since,
        or its lease expired); its tokens are settled all the same."""
        st = self._state.get(tenant_id)
        if st is None:
            return
        if counted and st.in_flight > 0:
            st.in_flight -= 1
        now = self._clock()
        st.expire(now)
        for name, bucket in st.buckets.items():
            if name != REQUESTS:  # a request stays counted; its tokens are settled
                bucket.settle(reserved, used, now)

    def in_flight(self, tenant_id: str) -> int:
        st = self._state.get(tenant_id)
        return st.in_flight if st else 0

    def remaining(self, tenant_id: str) -> dict[str, int]:
        """Tokens (or requests) left per bucket name, now, beyond what leases hold."""
        st = self._state.get(tenant_id)
        now = self._clock()
        out = {}
        if st is not None:
            st.expire(now)
        for name, bucket in (st.buckets.items() if st else ()):
            bucket.refill(now)
            out[name] = max(0, int(st.free(name)))
        return out

    def leases(self, tenant_id: str) -> dict[str, Hold]:
        """The tenant's budget leases now, lease id -> :class:`Hold` (expired ones
        dropped)."""
        st = self._state.get(tenant_id)
        if st is None:
            return {}
        st.expire(self._clock())
        return dict(st.holds)

    def export(self, tenant_id: str) -> dict[str, Any]:
        """The tenant's buckets and budget leases as JSON-able data, ``{"buckets": {name:
        [limit, window_s, level, at]}, "holds": {lease id: Hold.state()}}`` (``at``,
        ``until``: this counter's clock, s); in-flight counts are not in it."""
        st = self._state.get(tenant_id)
        if st is None:
            return {"buckets": {}}
        out: dict[str, Any] = {"buckets": {name: b.state() for name, b in st.buckets.items()}}
        if st.holds:
            out["holds"] = {lease: h.state() for lease, h in st.holds.items()}
        return out

    def load(self, tenant_id: str, data: dict[str, Any] | None, in_flight: int = 0) -> None:
        """Take a tenant's :meth:`export` back (None: a tenant with full buckets), with
        ``in_flight`` requests."""
        buckets = (data or {}).get("buckets") or {}
        holds = (data or {}).get("holds") or {}
        self._state[tenant_id] = _TenantState(
            in_flight, {name: TokenBucket.from_state(state) for name, state in buckets.items()},
            {lease: Hold.from_state(state) for lease, state in holds.items()})

    def renew(self, r: Renewal) -> Grant:
        """Apply a router's :class:`Renewal` of its budget lease and answer it (see
        :mod:`serve_app.tenancy.lease_terms`): its spending since its last renewal is drawn
        from the buckets (a negative figure, settlements, goes back), then the lease keeps
        ``r.keep`` and gets up to ``r.want``, the rest at most the router's share of what
        is free beyond ``r.pending`` (none below ``r.least``). A lease given back (``closing``)
        or that the ledger does not hold (expired, or closed) answers ``held`` False; the
        latter's report is not counted: an expired lease's credit was counted spent whole."""
        now = self._clock()
        st = self._tenant(r.tenant_id, r.limits, now)
        hold = st.holds.get(r.lease_id)
        if hold is None and r.seq > 1:
            return Grant(r.lease_id, r.seq, False, quota=self._quota(st, now))
        hold = st.holds.setdefault(r.lease_id, Hold())
        if r.seq <= hold.seq:  # a repeated renewal: the lease as it stands
            return self._grant(r.lease_id, st, hold, now)
        hold.seq = r.seq
        for name, bucket in st.buckets.items():
            spent = r.spent.get(name, 0.0) - hold.spent.get(name, 0.0)
            bucket.refill(now)
            bucket.level = min(float(bucket.limit), bucket.level - spent)
            hold.credit[name] = hold.credit.get(name, 0.0) - spent
        hold.spent = dict(r.spent)
        routers = max(1, r.routers, len(st.holds))
        kept = {name: min(hold.credit_in(name), r.keep.get(name, 0.0)) for name in st.buckets}
        fresh = {name: min(max(0.0, r.want.get(name, 0.0) - kept[name]),
                           share(bucket.level - st.held(name, but=r.lease_id) - kept[name]
                                 - r.pending.get(name, 0.0), routers))
                 for name, bucket in st.buckets.items()}
        if any(kept[name] + fresh[name] < r.least.get(name, 0.0) for name in st.buckets):
            fresh = dict.fromkeys(fresh, 0.0)  # too little to serve a request: none
        hold.credit = {name: kept[name] + fresh[name] for name in st.buckets}
        if r.closing:
            del st.holds[r.lease_id]  # given back: its credit is free again
            return Grant(r.lease_id, r.seq, False, quota=self._quota(st, now))
        hold.until = now + BUDGET_LEASE_TTL_S
        return self._grant(r.lease_id, st, hold, now)

    def _grant(self, lease_id: str, st: _TenantState, hold: Hold, now: float) -> Grant:
        return Grant(lease_id, hold.seq, True, dict(hold.credit), self._quota(st, now))

    def tenants(self) -> list[str]:
        return list(self._state)

    @contextmanager
    def all_or_nothing(self, tenant_id: str) -> Iterator[None]:
        """What the block changes of ``tenant_id``'s counts is kept only if it does not
        raise: on an exception its buckets and in-flight count are put back as they were,
        and the exception goes on (a ledger commits a tenant's counts only once saved)."""
        known = tenant_id in self._state
        data, in_flight = self.export(tenant_id), self.in_flight(tenant_id)
        try:
            yield
        except BaseException:
            if known:
                self.load(tenant_id, data, in_flight)
            else:
                self._state.pop(tenant_id, None)
            raise

    def seed(self, tenant_id: str, limits: Limits, left: dict[str, float]) -> None:
        """Start the tenant's buckets at ``left`` (bucket name -> level), keeping its
        in-flight count: a router's share of what another ledger said remained."""
        now = self._clock()
        st = self._tenant(tenant_id, limits, now)
        for name, level in left.items():
            if (bucket := st.buckets.get(name)) is not None:
                bucket.refill(now)
                bucket.level = min(float(bucket.limit), level)

