"""The ``redis`` ledger backend: tenant counts in a Redis server (:mod:`serve_app.tenancy.ledger`).

Each tenant is one key, ``mesh:ledger:tenant:<id>``, holding JSON: its token buckets and
the router replicas' budget leases on them (:meth:`TenantCounts.export`, on the Redis
server's clock, ``TIME``) and its in-flight **leases**, one per request counted here (lease
id -> expiry, s). A batch of asks or releases is one optimistic
transaction (``WATCH`` the batch's tenant keys, read them, count with the same
:class:`~serve_app.tenancy.counts.TenantCounts` every backend runs, ``MULTI``/``EXEC`` the
new values; retried when another router wrote one of those keys in between, at most
:data:`MAX_WATCH_RETRIES` times with a growing, jittered back-off, then raised: the router
applies the tenant's ``limits_fail_mode`` as for a ledger that does not answer), so two
routers never both spend the same tokens. A request's lease expires after :data:`LEASE_TTL_S`: a
router that dies holding requests does not hold its tenants' slots forever (a budget lease,
renewed every second, expires far sooner: :mod:`serve_app.tenancy.lease_terms`). A key idle for
:data:`KEY_TTL_S` (longer than any window) expires: its buckets would be full by then.

Retries are idempotent. Each ask's lease id is fixed before the first attempt (the batch's
id and the ask's place in it) and written in the same transaction as its counts, so an
attempt whose ``EXEC`` reply was lost (a connection dropped after Redis applied it) and is
run again finds the lease there and answers it without counting it a second time; a
settlement pops its lease, so a second attempt finds it gone and changes nothing. A budget
lease's renewal carries its sequence number and cumulative figures: applied once.

The server should run with ``appendonly yes`` so that its counts survive its restart
(``scripts/redis_ledger.sh`` starts one so).
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError

from serve_app.common.logs import get_logger
from serve_app.tenancy.counts import TenantCounts
from serve_app.tenancy.lease_terms import Grant, Renewal
from serve_app.tenancy.ledger_protocol import (Answer, Ask, AskFailed, Release, by_tenant,
                                              count_by_tenant)
from serve_app.tenancy.token_budget import WINDOW_S

logger = get_logger(__name__)

#: Seconds a lease (one request in flight) is held at most; longer than any request runs.
LEASE_TTL_S = 3600.0
#: Seconds an idle tenant's key is kept: two of the longest window.
KEY_TTL_S = int(2 * max(WINDOW_S.values()))
KEY_PREFIX = "mesh:ledger:tenant:"
#: Seconds a Redis call may take before the router's fail mode applies (it waits less).
SOCKET_TIMEOUT_S = 2.0
#: Transactions run again after another router wrote one of their keys, at most; then the
#: call raises (the router's fail mode applies). Back-off before retry ``n``: up to
#: ``min(BACKOFF_S * 2**n, MAX_BACKOFF_S)`` s, jittered, about 0.2 s over all of them.
MAX_WATCH_RETRIES = 10
BACKOFF_S, MAX_BACKOFF_S = 0.001, 0.032


class RedisLedger:
    """:class:`~serve_app.tenancy.ledger_protocol.Ledger` in the Redis server at ``url``
    (``redis://host:port/db``).

    Args:
        clock: seconds now, in place of the server's ``TIME`` (tests pass a fake).

    Raises (from every call): ``redis.exceptions.RedisError`` when the server cannot be
    reached; the router then applies the tenant's ``limits_fail_mode``.
    """

    backend = "redis"

    def __init__(self, url: str, prefix: str = KEY_PREFIX,
                 clock: Callable[[], float] | None = None) -> None:
        self.url = url
        self.prefix = prefix
        self._clock = clock
        self._redis = aioredis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                        socket_connect_timeout=SOCKET_TIMEOUT_S)

    async def ping(self) -> None:
        await self._redis.ping()

    async def acquire_many(self, asks: list[Ask]) -> list[Answer | AskFailed]:
        batch = uuid.uuid4().hex  # lease ids, fixed before the first attempt (idempotence)

        def count(counts: TenantCounts, leases: dict[str, dict[str, float]], now: float):
            answers: list[Answer | AskFailed] = [AskFailed("not counted")] * len(asks)
            for tenant_id, indices in by_tenant(asks).items():
                held = dict(leases[tenant_id])
                try:
                    with counts.all_or_nothing(tenant_id):
                        for i in indices:
                            answers[i] = self._count(counts, leases[tenant_id], asks[i],
                                                     f"{batch}-{i}", now)
                except Exception as e:  # noqa: BLE001 - that tenant's asks only
                    leases[tenant_id] = held
                    logger.warning("redis ledger: %d asks of tenant %r not counted (%s: %s)",
                                   len(indices), tenant_id, type(e).__name__, str(e)[:200])
                    for i in indices:
                        answers[i] = AskFailed(f"tenant {tenant_id!r}: {type(e).__name__}")
            return answers
        return await self._transaction([a[0] for a in asks], count)

    @staticmethod
    def _count(counts: TenantCounts, leases: dict[str, float], ask: Ask, lease: str,
               now: float) -> Answer:
        """One ask, counted under ``lease`` unless an earlier attempt of this transaction
        already counted it (its ``EXEC`` reply lost): then answered as it stands."""
        tenant_id, limits, tokens = ask
        if lease in leases:
            return lease, None, counts.quota(tenant_id, limits)
        refusal, quota = counts.acquire(tenant_id, limits, tokens)
        if refusal is not None:
            return "", refusal, quota
        leases[lease] = now + LEASE_TTL_S
        return lease, None, quota

    async def release_many(self, releases: list[Release]) -> None:
        def settle(counts: TenantCounts, leases: dict[str, dict[str, float]], now: float):
            for tenant_id, lease, reserved, used in releases:
                # A lease that is gone was settled already (a retried transaction) or
                # expired: its reservation stays charged, never settled twice.
                if leases[tenant_id].pop(lease, None) is not None:
                    counts.release(tenant_id, reserved, used)
        await self._transaction([r[0] for r in releases], settle)

    async def remaining(self, tenant_id: str) -> dict[str, int]:
        return await self._transaction([tenant_id], lambda counts, _, __: counts.remaining(
            tenant_id))

    async def renew_many(self, renewals: list[Renewal]) -> list[Grant | AskFailed]:
        return await self._transaction(
            [r.tenant_id for r in renewals],
            lambda counts, _, __: count_by_tenant(counts, renewals,
                                                  lambda i: counts.renew(renewals[i]),
                                                  what="lease renewals"))

    async def _transaction(self, tenant_ids: list[str], change) -> Any:
        """Run ``change(counts, leases, now)`` on the tenants' state read under ``WATCH``,
        and write it back in one ``MULTI``/``EXEC``; again if a key changed meanwhile (at
        most :data:`MAX_WATCH_RETRIES` times, backing off), and once after a lost
        connection. ``change`` must be idempotent across attempts (see the module
        docstring).

        Raises:
            redis.exceptions.WatchError: the keys kept changing through every retry.
            redis.exceptions.RedisError: the server cannot be reached.
        """
        tenants = sorted(set(tenant_ids))
        keys = [self.prefix + t for t in tenants]
        async with self._redis.pipeline(transaction=True) as pipe:
            reconnected, contended = False, 0
            while True:
                try:
                    await pipe.watch(*keys)
                    raw = await pipe.mget(keys)
                    seconds, micros = await pipe.time()
                    now = self._clock() if self._clock else seconds + micros / 1e6
                    counts = TenantCounts(clock=lambda: now)
                    leases: dict[str, dict[str, float]] = {}
                    for tenant_id, value in zip(tenants, raw):
                        data = json.loads(value) if value else {}
                        leases[tenant_id] = {lease: until for lease, until in
                                             (data.get("leases") or {}).items() if until > now}
                        counts.load(tenant_id, data, in_flight=len(leases[tenant_id]))
                    result = change(counts, leases, now)
                    pipe.multi()
                    for tenant_id, key in zip(tenants, keys):
                        value = {**counts.export(tenant_id), "leases": leases[tenant_id]}
                        pipe.set(key, json.dumps(value), ex=KEY_TTL_S)
                    await pipe.execute()
                    return result
                except WatchError:
                    contended += 1
                    if contended > MAX_WATCH_RETRIES:
                        logger.warning("redis ledger: tenants %s changed under %d attempts "
                                       "in a row; giving up on this call", tenants,
                                       contended)
                        raise
                    await asyncio.sleep(random.uniform(0, min(
                        BACKOFF_S * 2 ** contended, MAX_BACKOFF_S)))
                except RedisConnectionError:
                    # A pooled connection to a server that restarted fails once. Run again:
                    # should the lost reply have been EXEC's, the asks find their leases
                    # there (not counted twice) and a settlement finds its lease gone.
                    if reconnected:
                        raise
                    reconnected = True
