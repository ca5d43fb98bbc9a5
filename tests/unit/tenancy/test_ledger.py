"""The ledger contract (:mod:`serve_app.tenancy.ledger`): both backends, the same tests
(the backends: ``tests/support/ledger_backends.py``; their budget leases:
``tests/unit/tenancy/test_lease_keeper.py``). Each test runs two routers (two
:class:`TenantLimiter`, each with its own client of the backend) against one ledger, with
budget leases on, as routers run by default.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_app.common.errors import MeshError
from serve_app.tenancy.limits import TenantLimiter
from tests.support.ledger_backends import (RedisBackend, backend,  # noqa: F401 - a fixture
                                           granted)
from tests.support.tenants import tenant
from tests.support.waits import eventually


def two_routers(backend) -> tuple[TenantLimiter, TenantLimiter]:
    return TenantLimiter(shared=backend.client()), TenantLimiter(shared=backend.client())


def test_concurrent_reservations_from_two_routers_never_overdraw(backend):
    """40 asks of 100 tokens at once, half through each router, against 1,000 per minute:
    exactly 10 are granted. Settled at 50 each, half of what they drew comes back."""
    t = tenant(tokens_per_minute=1000)

    async def main():
        a, b = two_routers(backend)
        leases = await asyncio.gather(*(granted(a if i % 2 else b, t, 100) for i in range(40)))
        got = [(r, lease) for r, lease in zip([a, b] * 20, leases) if lease is not None]
        assert len(got) == 10, len(got)
        for router, lease in got:
            router.release(lease, used=50)
        await asyncio.sleep(0.2)  # give-backs are sent without waiting
        return await backend.client().remaining("t")

    left = asyncio.run(main())["tokens_per_minute"]
    assert 500 <= left <= 530, left  # 500 settled back, plus a moment's refill (16.7/s)


def test_the_concurrency_limit_holds_across_two_routers(backend):
    t = tenant(max_concurrent_requests=2)

    async def main():
        a, b = two_routers(backend)
        first, second = await a.acquire(t), await b.acquire(t)
        assert await granted(a, t, 0) is None and await granted(b, t, 0) is None
        a.release(first)
        await asyncio.sleep(0.2)
        assert await granted(b, t, 0) is not None
        assert await granted(a, t, 0) is None
        assert second is not None

    asyncio.run(main())


def test_the_window_refills_at_limit_per_window(backend):
    """600 per minute is 10 tokens/s: spent to 0, 20 tokens fit again about 2 s later."""
    t = tenant(tokens_per_minute=600)

    async def main():
        a, b = two_routers(backend)
        a.release(await a.acquire(t, 600), used=600)
        await asyncio.sleep(0.1)
        with pytest.raises(MeshError) as e:
            await b.acquire(t, 20)
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "2"
        await asyncio.sleep(2.1)
        assert await b.acquire(t, 20) is not None

    asyncio.run(main())


def test_a_cost_beyond_the_reservation_is_a_debt_paid_before_the_next_request(backend):
    t = tenant(tokens_per_day=1000)

    async def main():
        a, b = two_routers(backend)
        a.release(await a.acquire(t, 100), used=1300)  # 300 beyond the whole budget
        await asyncio.sleep(0.2)
        with pytest.raises(MeshError) as e:
            await b.acquire(t, 1)
        assert e.value.code == "tokens_exhausted" and "owes 30" in e.value.message, e.value

    asyncio.run(main())


def test_a_restart_of_the_ledger_gives_no_budget_back(backend):
    """The kill drill at the ledger's seam: a tenant spends its tokens_per_day down to a 429,
    the ledger dies and comes back, and the next request is still a 429. A request that was
    in flight across the restart settles its tokens when it ends."""
    t = tenant(tokens_per_day=1000)

    async def main():
        a, _ = two_routers(backend)
        a.release(await a.acquire(t, 800), used=800)
        in_flight = await a.acquire(t, 150)
        with pytest.raises(MeshError) as e:
            await a.acquire(t, 100)
        assert e.value.code == "tokens_exhausted", e.value
        backend.restart()
        after, other = two_routers(backend)
        with pytest.raises(MeshError) as e:
            await after.acquire(t, 100)
        assert e.value.code == "tokens_exhausted", e.value  # 50 left: 1000 - 800 - 150
        a.release(in_flight, used=50)  # settled by a router that counted it before
        await asyncio.sleep(0.3)
        left = (await backend.client().remaining("t"))["tokens_per_day"]
        assert 150 <= left <= 152, left  # 1000 - 800 - 50, and a moment's refill
        assert await other.acquire(t, 100) is not None

    asyncio.run(main())


def test_redis_leases_of_a_router_that_died_expire(tmp_path, monkeypatch):
    """A router that dies holding a request holds its tenant's slot until the lease
    expires, not forever."""
    from serve_app.tenancy import redis_ledger
    backend = RedisBackend(tmp_path)
    try:
        monkeypatch.setattr(redis_ledger, "LEASE_TTL_S", 1.0)
        t = tenant(max_concurrent_requests=1)

        async def main():
            dead, alive = two_routers(backend)
            assert await dead.acquire(t) is not None  # never released
            assert await granted(alive, t, 0) is None
            assert await eventually(lambda: granted(alive, t, 0), within_s=5, every_s=0.2
                                    ) is not None, "the dead router's lease did not expire"

        asyncio.run(main())
    finally:
        backend.stop()
