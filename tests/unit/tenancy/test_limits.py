"""Unit tests of the per-tenant limits (no Ray): the counts, and a router's limiter against
shared counts that answer, answer late, or fail (a fake handle in place of the Ray actor)."""

from __future__ import annotations

import asyncio

import pytest

import serve_app.tenancy.limits as limits
from serve_app.common.errors import MeshError
from serve_app.tenancy.counts import TenantCounts
from serve_app.tenancy.limits import TenantLimiter
from serve_app.tenancy.quota import Limits
from tests.support.clocks import FakeClock
from tests.support.fakes import FakeShared
from tests.support.tenants import tenant


def test_concurrency_limit_and_release():
    async def main():
        t, limiter = tenant(max_concurrent_requests=2), TenantLimiter(shared=None)
        a = await limiter.acquire(t)
        await limiter.acquire(t)
        with pytest.raises(MeshError) as e:
            await limiter.acquire(t)
        assert (e.value.status, e.value.code) == (429, "concurrency_limit_exceeded")
        assert e.value.headers == {"Retry-After": "1"}  # no rate limits: no x-ratelimit-*
        limiter.release(a)
        await limiter.acquire(t)  # a slot is free again
    asyncio.run(main())


def test_requests_per_minute_is_a_token_bucket():
    now = [1000.0]
    counts, rpm3 = TenantCounts(clock=lambda: now[0]), Limits(requests_per_minute=3)
    for _ in range(3):  # a full bucket: a burst of 3
        assert counts.acquire("t", rpm3)[0] is None
        counts.release("t")
    refusal, quota = counts.acquire("t", rpm3)
    assert (refusal.status, refusal.code, refusal.retry_after_s) == (429, "rate_limit_exceeded",
                                                                     20)  # 60 / 3 s a token
    assert quota.headers() == {"x-ratelimit-limit-requests": "3",
                               "x-ratelimit-remaining-requests": "0",
                               "x-ratelimit-reset-requests": "1m0s"}
    now[0] += 20
    assert counts.acquire("t", rpm3)[0] is None


def test_open_mode_and_unlimited_tenants_cost_no_call():
    async def main():
        shared = FakeShared(fail=True)  # would fail if asked
        limiter = TenantLimiter(shared=shared)
        for _ in range(100):
            assert await limiter.acquire(None) is None
            assert await limiter.acquire(tenant()) is None
        assert shared.calls == 0  # never asked
    asyncio.run(main())


def test_two_routers_share_one_count():
    async def main():
        shared, t = FakeShared(), tenant(max_concurrent_requests=2)
        r1, r2 = TenantLimiter(shared=shared), TenantLimiter(shared=shared)
        a = await r1.acquire(t)
        await r2.acquire(t)
        for r in (r1, r2):
            with pytest.raises(MeshError) as e:
                await r.acquire(t)
            assert e.value.status == 429 and "2 requests in flight" in e.value.message
        r1.release(a)
        await asyncio.sleep(0.01)  # give-backs go out in the background
        assert shared.counts.in_flight("t") == 1
        await r2.acquire(t)
        shared.incarnation = "two"  # Ray restarted the actor: an older lease frees nothing
        r1.release(a)
        await asyncio.sleep(0.01)
        assert shared.counts.in_flight("t") == 2
    asyncio.run(main())


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_unreachable_shared_counts_apply_the_fail_mode(mode):
    async def main():
        t = tenant(max_concurrent_requests=1, limits_fail_mode=mode)
        limiter = TenantLimiter(shared=FakeShared(fail=True))
        if mode == "closed":
            with pytest.raises(MeshError) as e:
                await limiter.acquire(t)
            assert (e.value.status, e.value.code) == (503, "limits_unavailable")
            assert e.value.headers == {"Retry-After": "5"}
            return
        lease = await limiter.acquire(t)  # counted on this router alone
        assert lease.shared is None
        with pytest.raises(MeshError) as e:
            await limiter.acquire(t)
        assert e.value.status == 429
        limiter.release(lease)
        await limiter.acquire(t)
    asyncio.run(main())


def test_open_mode_counts_from_this_routers_share_of_what_the_ledger_said_remained():
    """Issue 27: in open fail mode a router used to count a tenant from a full budget of its
    own. With 2 routers and 400 of 1,000 tokens left per the ledger's last answer, this
    router may spend 200 while the ledger is unreachable, not 1,000."""
    async def main():
        t = tenant(tokens_per_minute=1000, limits_fail_mode="open")
        shared = FakeShared()
        limiter = TenantLimiter(shared=shared, routers=lambda: 2)
        limiter.release(await limiter.acquire(t, 600), used=600)  # the ledger: 400 left
        shared.fail = True
        lease = await limiter.acquire(t, 150)
        assert lease.shared is None  # counted here
        with pytest.raises(MeshError) as e:
            await limiter.acquire(t, 100)  # 50 of this router's 200 left
        assert (e.value.status, e.value.code) == (429, "tokens_exhausted"), e.value
    asyncio.run(main())


def test_a_late_answer_gives_its_count_back_and_the_router_stops_asking_for_5_s(monkeypatch):
    """After a ledger answer later than ``SHARED_TIMEOUT_S`` the router counts every limited
    tenant from its share for 5 s (on its clock) without asking the ledger, then asks again.
    The late answer's count is given back."""
    monkeypatch.setattr(limits, "SHARED_TIMEOUT_S", 0.05)

    async def main():
        clock = FakeClock(100.0)
        shared, t = FakeShared(delay_s=0.2), tenant(max_concurrent_requests=1)
        limiter = TenantLimiter(shared=shared, clock=clock)
        lease = await limiter.acquire(t)  # timed out: counted locally (fail mode open)
        assert lease.shared is None and shared.calls == 1
        await asyncio.sleep(0.3)  # the late answer arrived and was given back
        assert shared.counts.in_flight("t") == 0
        limiter.release(lease)
        shared.delay_s = 0.0  # the ledger answers at once from now on: still not asked
        for after_s in (0.0, 2.5, 4.99):
            clock.now = 100.0 + after_s
            for who in (t, tenant("u", max_concurrent_requests=1)):
                counted = await limiter.acquire(who)
                assert counted.shared is None, after_s  # from this router's share
                limiter.release(counted)
        assert shared.calls == 1
        clock.now = 105.0
        assert (await limiter.acquire(t)).shared is shared  # 5 s later: asked again
        assert shared.calls == 2
    asyncio.run(main())


def test_a_client_leaving_while_the_router_asks_frees_its_count():
    async def main():
        shared, t = FakeShared(delay_s=0.1), tenant(max_concurrent_requests=1)
        asking = asyncio.ensure_future(TenantLimiter(shared=shared).acquire(t))
        await asyncio.sleep(0.02)
        asking.cancel()
        await asyncio.sleep(0.2)  # the shared counts answered after the client left
        assert shared.counts.in_flight("t") == 0
    asyncio.run(main())


def test_asks_are_batched_while_one_call_is_in_flight():
    """200 concurrent asks of one router go out in a few calls (one in flight, the rest
    collect); one ask alone goes out at once, in a call of its own."""
    async def main():
        shared, t = FakeShared(delay_s=0.01), tenant(max_concurrent_requests=10**6)
        limiter = TenantLimiter(shared=shared)
        await limiter.acquire(t)
        assert shared.calls == 1
        leases = await asyncio.gather(*(limiter.acquire(t) for _ in range(200)))
        assert shared.calls <= 3, shared.calls
        assert shared.counts.in_flight("t") == 201
        for lease in leases:
            limiter.release(lease)
        await asyncio.sleep(0.05)
        assert shared.counts.in_flight("t") == 1
    asyncio.run(main())
