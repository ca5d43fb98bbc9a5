"""Budget leases (:mod:`serve_app.tenancy.lease_terms`, :mod:`serve_app.tenancy.lease_keeper`):
the ledger contract's lease part, both backends, the same tests
(``tests/support/ledger_backends.py``; the Redis one against a real ``redis-server``).

The ledger and the routers run on one fake clock; routers renew when a test says so (as
their background task does every ``RENEW_S``). A router's ledger calls are counted.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError
from serve_app.tenancy.lease_keeper import EXPIRY_MARGIN_S, LEASE_MIN_REQUESTS
from serve_app.tenancy.lease_terms import (BUDGET_LEASE_TTL_S, LEASE_RETRY_AFTER_S,
                                           RENEW_S, Renewal)
from serve_app.tenancy.limits import TenantLimiter
from serve_app.tenancy.quota import Limits
from tests.support.ledger_backends import (CountingLedger, backend,  # noqa: F401 - fixtures
                                           clocked, granted)
from tests.support.tenants import tenant
from tests.support.waits import eventually

DAY = 86400.0


def router(backend, routers: int = 2, **kw) -> TenantLimiter:
    """A router replica of ``routers`` against ``backend``, on its clock; its ledger client's
    calls are counted (``router.ledger``)."""
    ledger = CountingLedger(backend.client())
    limiter = TenantLimiter(shared=ledger, routers=lambda: routers, clock=backend.clock,
                            renew_in_background=False, **kw)
    limiter.ledger = ledger
    return limiter


async def busy(limiter: TenantLimiter, t: Tenant, tokens: int, clock) -> None:
    """Make ``t`` busy on ``limiter`` (requests of ``tokens`` each, settled at their
    reservation), then one ``RENEW_S`` later renew: its lease opens."""
    for _ in range(LEASE_MIN_REQUESTS):  # each waits for the last one's settlement
        counted = await eventually(lambda: granted(limiter, t, tokens))
        assert counted is not None
        limiter.release(counted, tokens)
    await asyncio.sleep(0.01)  # settlements go out in the background
    clock.advance(RENEW_S)
    await limiter.leases.renew()


def lease_of(limiter: TenantLimiter, tenant_id: str = "t"):
    return limiter.leases.leases.get(tenant_id)


def test_a_busy_tenant_is_served_from_its_lease_without_a_ledger_call(clocked):
    """After its lease opens, 12 requests cost no ask and no settlement call; their
    settlements (one over its reservation: a debt) reach the ledger with the next renewal,
    exactly."""
    t = tenant(tokens_per_day=100_000)

    async def main():
        a = router(clocked)
        await busy(a, t, 100, clocked.clock)
        lease = lease_of(a)
        assert lease is not None
        calls = a.ledger.asks()
        for i in range(12):  # 800 of credit: 150, then 40 a request
            counted = await a.acquire(t, 100)
            assert counted.lease is lease, i
            assert counted.quota.headers()["x-ratelimit-limit-tokens"] == "100000"
            a.release(counted, 150 if i == 0 else 40)  # 50 over, then 60 back each
        assert a.ledger.asks() == calls, a.ledger.calls
        await a.leases.renew()
        held = lease.left("tokens_per_day")
        left = (await clocked.client().remaining("t"))["tokens_per_day"]
        spent = 4 * 100 + 150 + 11 * 40
        assert abs(left + held - (100_000 - spent)) <= 3, (left, held)  # 3: a day's refill
    asyncio.run(main())


def test_a_request_asked_of_the_ledger_shows_in_the_next_leased_requests_headers(clocked):
    """A request too big for the lease is asked of the ledger; the next request the lease
    covers reports remaining tokens after it at once, not at the next renewal (its
    ``x-ratelimit-remaining-tokens`` was the last grant's figure, a whole charge too high)."""
    t = tenant(tokens_per_day=100_000)

    def remaining(counted) -> int:
        return int(counted.quota.headers()["x-ratelimit-remaining-tokens"])

    async def main():
        a = router(clocked)
        await busy(a, t, 100, clocked.clock)
        lease = lease_of(a)
        assert lease is not None
        before = await a.acquire(t, 100)
        assert before.lease is lease
        big = await a.acquire(t, 5_000)  # more than the lease's credit: asked
        assert big.lease is None
        after = await a.acquire(t, 100)
        assert after.lease is lease
        assert remaining(before) - remaining(after) == 5_000 + 100, (remaining(before),
                                                                     remaining(after))
    asyncio.run(main())


def test_leases_keep_a_budget_across_routers(clocked):
    """tokens_per_day 2,000, two routers, requests reserving 100 and costing 60, leases
    renewed every second: the tokens served stay within the budget (and the day's refill
    over the test), and reach it once idle leases are given back."""
    t = tenant(tokens_per_day=2000)

    async def main():
        routers = [router(clocked), router(clocked)]
        cost, seconds = 0, 0.0
        for a in routers:
            await busy(a, t, 100, clocked.clock)
            cost += LEASE_MIN_REQUESTS * 100
        for _ in range(8):
            for a in routers:
                for _ in range(6):
                    counted = await granted(a, t, 100)
                    if counted is not None:
                        a.release(counted, 60)
                        cost += 60
            await asyncio.sleep(0.01)
            clocked.clock.advance(RENEW_S)
            seconds += RENEW_S
            for a in routers:
                await a.leases.renew()
        for _ in range(2):  # idle: every lease is given back
            clocked.clock.advance(RENEW_S)
            seconds += RENEW_S
            for a in routers:
                await a.leases.renew()
        assert not any(lease_of(a) for a in routers)
        while (counted := await granted(routers[0], t, 100)) is not None:
            routers[0].release(counted, 60)
            cost += 60
            await asyncio.sleep(0.01)  # its settlement goes out in the background
        refill = 2000 * (seconds + 2 * RENEW_S) / DAY
        print(f"\n{cost} tokens served of a 2,000 budget")
        assert 2000 - 100 < cost <= 2000 + refill + 1
    asyncio.run(main())


def test_a_concurrency_limit_is_never_leased_and_a_burst_gets_all_of_it(clocked):
    """max_concurrent_requests 16 on two routers, both busy: neither holds a lease (a slot
    lent to one router and idle there would refuse the other's request below the limit), so
    a burst of 16 at once, 15 on router b and 1 on a, gets all 16 in flight, and the 17th
    request gets 429 concurrency_limit_exceeded."""
    limit = 16
    t = tenant(max_concurrent_requests=limit, tokens_per_day=100_000)

    async def main():
        a, b = router(clocked), router(clocked)
        await busy(a, t, 100, clocked.clock)
        await busy(b, t, 100, clocked.clock)
        assert lease_of(a) is None and lease_of(b) is None
        burst = await asyncio.gather(*(granted(b, t, 100) for _ in range(limit - 1)),
                                     granted(a, t, 100))
        assert sum(c is not None for c in burst) == limit
        assert all(c.lease is None for c in burst)  # each asked the ledger
        with pytest.raises(MeshError) as e:
            await a.acquire(t, 100)
        assert e.value.status == 429 and e.value.code == "concurrency_limit_exceeded"
        b.release(burst[0], 100)
        assert await eventually(lambda: granted(a, t, 100)) is not None  # its slot is free
    asyncio.run(main())


def test_an_idle_lease_is_kept_while_a_request_on_it_runs(clocked):
    """A request on router a's lease runs through renewals with no new request: the idle
    lease is kept (no fresh credit) so that the request's settlement comes back through it;
    at the first idle renewal after it ended the lease is given back, and the ledger has
    counted what the request cost, not what it reserved."""
    t = tenant(tokens_per_day=10_000)

    async def main():
        a = router(clocked)
        await busy(a, t, 100, clocked.clock)
        lease = lease_of(a)
        long = await a.acquire(t, 100)
        assert long.lease is lease
        for _ in range(2):  # the second finds the tenant idle
            clocked.clock.advance(RENEW_S)
            await a.leases.renew()
            assert lease_of(a) is lease
        a.release(long, 40)
        clocked.clock.advance(RENEW_S)
        await a.leases.renew()
        assert lease_of(a) is None
        left = (await clocked.client().remaining("t"))["tokens_per_day"]
        expected = 10_000 - LEASE_MIN_REQUESTS * 100 - 40
        assert expected <= left <= expected + 1, (left, expected)  # 1: the refill
    asyncio.run(main())


def test_a_refusal_for_credit_another_router_holds_says_when_it_comes_back(clocked):
    """Router a's lease holds credit it does not spend; router b's request that only that
    credit would fit is refused with a Retry-After of LEASE_RETRY_AFTER_S (a's idle lease
    gives it back within two renewals), not of the refill's wait; once a renewed idle, the
    same request is served."""
    t = tenant(tokens_per_day=1000)

    async def main():
        a, b = router(clocked), router(clocked)
        await busy(a, t, 100, clocked.clock)
        held = lease_of(a).left("tokens_per_day")
        assert held >= 200
        while (counted := await granted(b, t, 100)) is not None:
            b.release(counted, 100)
        with pytest.raises(MeshError) as e:
            await b.acquire(t, 100)
        assert e.value.code == "tokens_exhausted"
        assert e.value.headers["Retry-After"] == str(LEASE_RETRY_AFTER_S)
        assert int(e.value.headers["x-ratelimit-remaining-tokens"]) < 100
        clocked.clock.advance(RENEW_S)
        await a.leases.renew()
        assert lease_of(a) is None  # idle: given back
        assert await b.acquire(t, 100) is not None
    asyncio.run(main())


def test_a_lease_lost_with_its_router_expires_within_its_ttl_counted_spent(clocked):
    """Router a holds a lease, spends some of it unreported, and dies (kill -9: no renewal,
    no give-back). Until the lease's TTL the ledger holds it (a repeat of its last renewal
    finds it) and its credit is free to no one else; after it, well within one window, the
    ledger holds it no more and its whole credit is counted spent (it may have been used):
    nothing comes back."""
    assert BUDGET_LEASE_TTL_S < 60  # the shortest window
    t = tenant(tokens_per_day=10_000)

    async def main():
        a = router(clocked)
        await busy(a, t, 100, clocked.clock)
        lease = lease_of(a)
        credit = lease.left("tokens_per_day")
        assert credit >= 200
        in_flight = [await a.acquire(t, 100) for _ in range(2)]
        assert all(c.lease is lease for c in in_flight)  # spent, never reported
        # Its last renewal sent again: the ledger answers with the lease as it stands.
        last = Renewal("t", lease.id, lease.seq, Limits.of(t), routers=2)
        del a  # kill -9
        ledger = clocked.client()
        expected = 10_000 - LEASE_MIN_REQUESTS * 100 - credit
        free_before = (await ledger.remaining("t"))["tokens_per_day"]
        assert expected - 1 <= free_before <= expected + 1, (free_before, expected)

        clocked.clock.advance(BUDGET_LEASE_TTL_S - 1)
        [grant] = await ledger.renew_many([last])
        assert grant.held and grant.credit == {"tokens_per_day": credit}  # still held
        clocked.clock.advance(1.5)  # past its TTL
        [grant] = await ledger.renew_many([last])
        assert not grant.held  # expired
        left = (await ledger.remaining("t"))["tokens_per_day"]
        refill = 10_000 * (BUDGET_LEASE_TTL_S + 1.5 + RENEW_S) / DAY
        assert expected - 1 <= left <= expected + refill + 1, (left, expected)
    asyncio.run(main())


def test_a_ledger_restart_keeps_the_leases(clocked):
    """The ledger dies and comes back (the actor restarted from the GCS, Redis from its
    append-only file): the router's lease is still held, and what it spent meanwhile is
    counted at its next renewal."""
    t = tenant(tokens_per_day=10_000)

    async def main():
        a = router(clocked)
        await busy(a, t, 100, clocked.clock)
        lease = lease_of(a)
        for _ in range(3):
            a.release(await a.acquire(t, 100), 100)
        clocked.restart()
        await a.leases.renew()
        assert lease_of(a) is lease
        held = lease.left("tokens_per_day")
        left = (await clocked.client().remaining("t"))["tokens_per_day"]
        assert abs(left + held - (10_000 - 700)) <= 1, (left, held)
    asyncio.run(main())


def test_a_renewal_applied_twice_counts_once(clocked):
    """A renewal whose answer was lost and is sent again (or a retried transaction) counts
    its spending once: it is cumulative, and its sequence number was applied."""
    limits = Limits(tokens_per_day=10_000)

    async def main():
        ledger = clocked.client()
        [grant] = await ledger.renew_many([Renewal("t", "r1", 1, limits, want={
            "tokens_per_day": 1000}, routers=1)])
        assert grant.held and grant.credit == {"tokens_per_day": 1000}
        second = Renewal("t", "r1", 2, limits, spent={"tokens_per_day": 300},
                         keep={"tokens_per_day": 700}, want={"tokens_per_day": 700}, routers=1)
        for _ in range(2):
            [grant] = await ledger.renew_many([second])
            assert grant.credit == {"tokens_per_day": 700}
        assert (await ledger.remaining("t"))["tokens_per_day"] == 10_000 - 300 - 700
        [stale] = await ledger.renew_many([Renewal("t", "gone", 5, limits)])
        assert not stale.held  # a lease the ledger does not hold: the router drops it
    asyncio.run(main())


def test_with_the_ledger_down_a_router_spends_its_lease_then_its_share(clocked):
    """limits_fail_mode open: with the ledger down, router a serves from its lease until its
    credit runs out, then from its share of what the ledger last said was free (as without
    leases); router b's lease, past its deadline, is not spent any more."""
    t = tenant(tokens_per_day=10_000, limits_fail_mode="open")

    async def main():
        a, b = router(clocked), router(clocked)
        await busy(b, t, 100, clocked.clock)
        await busy(a, t, 100, clocked.clock)
        lease = lease_of(a)
        credit = lease.left("tokens_per_day")
        clocked.take_down()
        assert (await a.acquire(t, 100)).lease is lease  # in use: not idle at its renewal
        await a.leases.renew()  # fails: the lease goes on, frozen at what it kept
        from_lease = 1
        while (counted := await a.acquire(t, 100)).lease is lease:
            from_lease += 1
        assert from_lease == credit // 100 and from_lease >= 2
        assert counted.shared is None  # this router's share, as without leases

        assert (await b.acquire(t, 100)).lease is lease_of(b)
        clocked.clock.advance(BUDGET_LEASE_TTL_S - EXPIRY_MARGIN_S)
        counted = await b.acquire(t, 100)
        assert counted.lease is None and counted.shared is None
    asyncio.run(main())


def test_leases_off_ask_the_ledger_for_every_request(clocked):
    """``ledger.leases: false``: the baseline, an ask and a settlement per request."""
    t = tenant(tokens_per_day=100_000)

    async def main():
        a = router(clocked, leases=False)
        await busy(a, t, 100, clocked.clock)
        assert lease_of(a) is None
        before = a.ledger.asks()
        for _ in range(10):
            a.release(await a.acquire(t, 100), 100)
        await asyncio.sleep(0.05)
        assert a.ledger.asks() - before >= 11  # 10 asks, and their settlements batched
    asyncio.run(main())


def test_in_the_background_a_busy_tenant_stops_asking_the_ledger(backend):
    """On the real clock, with the routers' background renewals: a busy tenant's lease opens
    at its 4th request and grows with its demand (renewed at once when it runs dry); then
    of its next 400 requests (8 in flight) at most two ask the ledger (while a renewal is in
    flight the lease spends only what it keeps), and the lease is renewed a few times."""
    t = tenant(tokens_per_day=10**9, requests_per_minute=10**9)

    async def main():
        ledger = CountingLedger(backend.client())
        a = TenantLimiter(shared=ledger, routers=lambda: 2)

        async def requests(n: int) -> None:
            left = iter(range(n))

            async def one() -> None:
                for _ in left:
                    counted = await a.acquire(t, 100)
                    await asyncio.sleep(0.001)
                    a.release(counted, 60)
            await asyncio.gather(*(one() for _ in range(8)))
        await requests(LEASE_MIN_REQUESTS)
        assert await eventually(lambda: asyncio.sleep(0.01, lease_of(a))) is not None
        await requests(200)  # its demand measured: the lease grows to it
        await asyncio.sleep(0.05)
        asks, renewals = ledger.asks(), ledger.calls["renew_many"]
        await requests(400)
        print(f"\n400 requests: {ledger.asks() - asks} ledger asks and settlements, "
              f"{ledger.calls['renew_many'] - renewals} renewals")
        assert ledger.asks() - asks <= 4, ledger.calls  # two asks and their settlements
        assert ledger.calls["renew_many"] - renewals <= 5
    asyncio.run(main())
