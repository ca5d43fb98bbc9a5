"""Per-tenant limits on requests and tokens, held across every router replica.

- ``max_concurrent_requests``: requests in flight (a stream counts until it ends).
- ``requests_per_minute``: a bucket holding ``rpm`` requests, refilled at ``rpm / 60`` per
  second (the usual token-bucket rate limiter).
- ``tokens_per_minute``, ``tokens_per_day``: buckets of prompt + completion tokens, drawn by
  a reservation at admission and settled with the real usage when the request ends
  (:mod:`serve_app.ingress.token_budget`). Over budget: 429 ``tokens_exhausted``.

Every answer to a limited tenant carries OpenAI's ``x-ratelimit-*`` headers (:class:`Quota`).

:class:`TenantCounts` is the counting, pure. The counts that hold cluster-wide live in one
Ray actor, :class:`SharedTenantCounts` (named, detached, restarted by Ray when it dies), so a
tenant limited to 2 in flight gets 2 across all routers. A router's :class:`TenantLimiter`
asks it once per request of a *limited* tenant (tenants without limits cost nothing) and
gives the slot back without waiting. A router's asks and give-backs are batched
(:mod:`serve_app.ingress.call_batcher`): one call in flight per router, the requests that
arrive meanwhile go in the next one, so the actor's ~1 ms per call is paid per batch.

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
from dataclasses import astuple, dataclass, field, replace

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.common.logs import get_logger
from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError
from serve_app.ingress.call_batcher import MAX_BATCH, CallBatcher
from serve_app.ingress.token_budget import WINDOW_S, TokenBucket, duration_header

logger = get_logger(__name__)

#: The shared counts' actor: name and namespace (one per Ray cluster). The actor is detached:
#: it outlives `serve shutdown`, so its name carries the version of its calls' protocol, and
#: routers of a new version never call an older actor (2: batched calls and token budgets).
SHARED_NAME, SHARED_NAMESPACE = "mesh-tenant-counts-2", "model-mesh"
#: Seconds a router waits for the shared counts before using the tenant's fail mode.
SHARED_TIMEOUT_S = 0.5
#: Seconds a router stops asking after the shared counts did not answer.
RETRY_SHARED_S = 5.0


#: The tenant's limits that are token buckets, with their windows (s). The requests bucket
#: draws 1 per request, the token buckets a request's reserved tokens (:func:`_draw`).
REQUESTS = "requests_per_minute"
BUCKET_WINDOWS_S = {REQUESTS: 60.0, **WINDOW_S}


def _draw(bucket_name: str, tokens: int) -> int:
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


@dataclass
class _TenantState:
    in_flight: int = 0
    buckets: dict[str, TokenBucket] = field(default_factory=dict)


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
                bucket.take(_draw(name, tokens))
            st.in_flight += 1
        quota = self._quota(st, now)
        return (replace(refusal, quota=quota) if refusal else None), quota

    @staticmethod
    def _refusal(tenant_id: str, st: _TenantState, limits: Limits, tokens: int,
                 now: float) -> Refusal | None:
        if limits.max_concurrent_requests and st.in_flight >= limits.max_concurrent_requests:
            return Refusal(429, f"tenant {tenant_id!r} has {st.in_flight} requests in flight; "
                           f"the limit is {limits.max_concurrent_requests}",
                           "concurrency_limit_exceeded", 1)
        for name, bucket in st.buckets.items():
            wait_s = bucket.wait_s(_draw(name, tokens), now)
            if wait_s == 0:
                continue
            if name == REQUESTS:
                return Refusal(429, f"tenant {tenant_id!r} is over its limit of "
                               f"{bucket.limit} requests per minute", "rate_limit_exceeded",
                               math.ceil(wait_s))
            if math.isinf(wait_s):
                return Refusal(400, f"the request reserves {tokens} tokens (prompt estimate "
                               "plus what vLLM may generate for it: max_tokens x n per "
                               "prompt; unset, the rest of the context), more than "
                               f"tenant {tenant_id!r}'s whole {name} of {bucket.limit}; set a "
                               "smaller max_tokens", "reservation_exceeds_budget", None)
            left = (f"has {int(bucket.level)} of its {name} {bucket.limit} left"
                    if bucket.level >= 0 else f"owes {math.ceil(-bucket.level)} tokens of its "
                    f"{name} {bucket.limit} (its requests cost more than they reserved)")
            return Refusal(429, f"tenant {tenant_id!r} {left} and this request reserves "
                           f"{tokens}; retry in {math.ceil(wait_s)} s or set a smaller "
                           "max_tokens", "tokens_exhausted", math.ceil(wait_s))
        return None

    @staticmethod
    def _quota(st: _TenantState, now: float) -> Quota:
        def figures(name: str) -> tuple[int, int, float] | None:
            b = st.buckets.get(name)
            return None if b is None else (b.limit, max(0, int(b.level)), b.reset_s(now))
        return Quota(requests=figures(REQUESTS),
                     tokens=figures("tokens_per_minute") or figures("tokens_per_day"))

    def release(self, tenant_id: str, reserved: int = 0, used: int = 0) -> None:
        """A counted request ended, having cost ``used`` of the ``reserved`` tokens."""
        st = self._state.get(tenant_id)
        if st is None:
            return
        if st.in_flight > 0:
            st.in_flight -= 1
        now = self._clock()
        for name, bucket in st.buckets.items():
            if name != REQUESTS:  # a request stays counted; its tokens are settled
                bucket.settle(reserved, used, now)

    def in_flight(self, tenant_id: str) -> int:
        st = self._state.get(tenant_id)
        return st.in_flight if st else 0

    def remaining(self, tenant_id: str) -> dict[str, int]:
        """Tokens (or requests) left per bucket name, now."""
        st = self._state.get(tenant_id)
        now = self._clock()
        out = {}
        for name, bucket in (st.buckets.items() if st else ()):
            bucket.refill(now)
            out[name] = max(0, int(bucket.level))
        return out


@ray.remote(num_cpus=0, max_restarts=-1)
class SharedTenantCounts:
    """The cluster's one :class:`TenantCounts` (a Ray actor: calls run one at a time).

    ``incarnation`` changes when Ray restarts the actor (its counts start from zero), so a
    release meant for an earlier incarnation is ignored rather than freeing a slot twice.
    """

    def __init__(self) -> None:
        self.counts = TenantCounts()
        self.incarnation = uuid.uuid4().hex

    def acquire(self, tenant_id: str, limits: Limits, tokens: int = 0
                ) -> tuple[str, Refusal | None, Quota]:
        return self.incarnation, *self.counts.acquire(tenant_id, limits, tokens)

    def release(self, tenant_id: str, incarnation: str, reserved: int = 0,
                used: int = 0) -> None:
        if incarnation == self.incarnation:
            self.counts.release(tenant_id, reserved, used)

    def acquire_many(self, requests: list[tuple[str, Limits, int]]
                     ) -> list[tuple[str, Refusal | None, Quota]]:
        """:meth:`acquire` for each ``(tenant_id, limits, tokens)``, in one call."""
        return [self.acquire(*request) for request in requests]

    def release_many(self, releases: list[tuple[str, str, int, int]]) -> None:
        """:meth:`release` for each ``(tenant_id, incarnation, reserved, used)``."""
        for release in releases:
            self.release(*release)

    def in_flight(self, tenant_id: str) -> int:
        return self.counts.in_flight(tenant_id)

    def remaining(self, tenant_id: str) -> dict[str, int]:
        return self.counts.remaining(tenant_id)


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
    router's own counts), the tokens it reserved and the tenant's quota after it."""

    tenant_id: str
    shared: object | None = None
    incarnation: str = ""
    reserved: int = 0
    quota: Quota = Quota()


class _SharedCalls:
    """The calls to one :class:`SharedTenantCounts` handle, batched (:class:`CallBatcher`)."""

    def __init__(self, shared, max_batch: int = MAX_BATCH) -> None:
        self.shared = shared
        self.acquires = CallBatcher(lambda requests: shared.acquire_many.remote(requests),
                                    max_batch)
        self.releases = CallBatcher(self._release_many, max_batch)

    async def _release_many(self, releases: list[tuple]) -> list[None]:
        # Awaited so that one release call is in flight and the next batch collects; no
        # request waits for it. An actor that died took its counts with it: nothing to undo.
        try:
            await self.shared.release_many.remote(releases)
        except RayError:
            pass
        return [None] * len(releases)

    def give_back(self, lease: Lease, used: int = 0) -> None:
        """Release ``lease``'s count, settling ``used`` tokens."""
        self.releases.submit((lease.tenant_id, lease.incarnation, lease.reserved, used))


class TenantLimiter:
    """A router replica's side of the tenant limits: shared counts, with a fallback.

    Args:
        shared: the :class:`SharedTenantCounts` handle, or a factory returning one (called
            again after a failure); None counts on this router only (unit tests).
        max_batch: most asks (or give-backs) in one call to the shared counts; 1 sends
            each in a call of its own (the unbatched baseline of ``scripts/bench.py --limits``).
    """

    def __init__(self, shared=shared_tenant_counts, max_batch: int = MAX_BATCH) -> None:
        self._max_batch = max_batch
        self._factory = shared if callable(shared) else None
        self._calls: _SharedCalls | None = None
        self._shared = None if callable(shared) else shared
        self._local = TenantCounts()
        self._down_until = 0.0 if shared is not None else math.inf

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
            await asyncio.wait_for(self._shared.in_flight.remote(""), timeout_s)
        except Exception as e:  # noqa: BLE001 - logged; acquire() handles the rest
            logger.warning("shared tenant counts not ready (%s: %s)", type(e).__name__, e)

    async def acquire(self, tenant: Tenant | None, tokens: int = 0) -> Lease | None:
        """Count a new request of ``tenant`` that reserves ``tokens`` (prompt + completion,
        :mod:`serve_app.ingress.token_budget`); None when the tenant has no limits (nothing
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
            raise MeshError(503, f"tenant {tenant.id!r} has limits and the mesh cannot count "
                            "them right now (limits_fail_mode: closed); retry shortly",
                            code="limits_unavailable",
                            headers={"Retry-After": str(math.ceil(RETRY_SHARED_S))})
        refusal, quota = self._local.acquire(*limits)
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
        except Exception as e:  # noqa: BLE001 - a dead actor, or one that cannot answer this
            return self._unavailable(f"{type(e).__name__}: {e}"[:200])
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


def _release_late(answer: asyncio.Future, calls: _SharedCalls, limits: tuple) -> None:
    """A late answer of the shared counts: give back the slot and tokens it counted, if
    any (the request did not run on them)."""
    if answer.cancelled() or answer.exception() is not None:
        return
    incarnation, refusal, _ = answer.result()
    if refusal is None:
        calls.give_back(Lease(limits[0], calls.shared, incarnation, limits[2]), 0)
