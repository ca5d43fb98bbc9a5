"""Fail-open counts a tenant on each router from that router's share of its limits (no Ray: a
ledger that fails every call in place of the actor).

Before, a router with no last figure from the ledger for a tenant (a router just started
or restarted, or the tenant's first request since the outage began) counted it from a
whole budget of its own: three routers with the ledger down admitted 30,000 tokens of a
10,000 ``tokens_per_day`` budget.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError
from serve_app.tenancy.limits import TenantLimiter
from tests.support.fakes import FakeShared
from tests.support.tenants import tenant

ROUTERS = 3


def acme(**limits) -> Tenant:
    """Tenant ``acme``, ``limits_fail_mode: open``, with ``limits``."""
    return tenant("acme", limits_fail_mode="open", **limits)


async def admitted(routers: list[TenantLimiter], t: Tenant, tokens: int) -> list[int]:
    """Requests of ``tokens`` each that each router admits, asked in turn until all refuse
    (each with a 429; none is released)."""
    counts, refusing = [0] * len(routers), set()
    while len(refusing) < len(routers):
        for i, router in enumerate(routers):
            if i in refusing:
                continue
            try:
                await router.acquire(t, tokens)
                counts[i] += 1
            except MeshError as e:
                assert e.status == 429, e
                refusing.add(i)
    return counts


def down_routers(shared: FakeShared | None = None) -> list[TenantLimiter]:
    shared = shared or FakeShared(fail=True)
    return [TenantLimiter(shared=shared, routers=lambda: ROUTERS) for _ in range(ROUTERS)]


def test_fresh_routers_with_the_ledger_down_grant_their_share_of_the_budget_each():
    """Each of 3 routers grants its share, 3,333 of 10,000 tokens: 33 requests of 100 (a
    34th would pass it), 9,900 tokens between them, never more than the budget."""
    async def main():
        t = acme(tokens_per_day=10_000)
        assert await admitted(down_routers(), t, 100) == [33, 33, 33]
    asyncio.run(main())


def test_requests_per_minute_and_concurrency_are_shared_too():
    async def main():
        assert await admitted(down_routers(), acme(requests_per_minute=30), 0) == [10] * 3
        assert await admitted(down_routers(), acme(max_concurrent_requests=6), 0) == [2] * 3
    asyncio.run(main())


def test_a_tenant_s_first_request_during_an_outage_starts_from_the_share():
    """The router has figures for another tenant, none for this one."""
    async def main():
        shared = FakeShared()
        routers = down_routers(shared)
        other = tenant("other", tokens_per_day=500)
        for router in routers:
            router.release(await router.acquire(other, 10), used=10)  # the ledger answers
        shared.fail = True
        assert await admitted(routers, acme(tokens_per_day=10_000), 100) == [33, 33, 33]
    asyncio.run(main())


def test_a_request_over_the_share_but_within_the_budget_is_503_not_400():
    """4,000 of a 10,000 budget fits it (a 400 would say it never can), and not a router's
    share of 3,333: the outage's 503, with Retry-After."""
    async def main():
        router = down_routers()[0]
        with pytest.raises(MeshError) as e:
            await router.acquire(acme(tokens_per_day=10_000), 4_000)
        assert (e.value.status, e.value.code) == (503, "limits_unavailable")
        assert "Retry-After" in e.value.headers
        with pytest.raises(MeshError) as e:  # more than the whole budget: still the 400
            await router.acquire(acme(tokens_per_day=10_000), 20_000)
        assert (e.value.status, e.value.code) == (400, "reservation_exceeds_budget")
    asyncio.run(main())
