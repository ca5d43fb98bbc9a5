"""The Redis ledger's retries are idempotent and bounded, and one tenant's error is its own
(a real ``redis-server`` on 127.0.0.1; a lost reply and a busy key are injected into
redis-py's pipeline).

Before: a lost ``EXEC`` reply counted the ask twice on the retry (its extra lease held a
``max_concurrent_requests: 1`` tenant out for ``LEASE_TTL_S``, an hour); ``WatchError``
retries had no cap and no back-off; and one tenant's error failed the whole batch.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError

import serve_app.tenancy.redis_ledger as redis_ledger
from serve_app.common.errors import MeshError
from serve_app.tenancy.limits import TenantLimiter
from serve_app.tenancy.quota import Limits
from serve_app.tenancy.redis_ledger import KEY_PREFIX, RedisLedger
from bench.servers import start_redis
from tests.support.tenants import tenant

ONE = Limits(max_concurrent_requests=1, tokens_per_day=1000)


@pytest.fixture
def url(tmp_path):
    proc, url = start_redis(str(tmp_path))
    yield url
    proc.kill()
    proc.wait()


def stored(url: str, tenant_id: str) -> dict:
    return json.loads(redis.Redis.from_url(url).get(KEY_PREFIX + tenant_id) or "{}")


def lose_exec_replies(monkeypatch, times: int = 1) -> list[int]:
    """EXEC is applied by the server, then the connection drops before its reply."""
    real, lost = Pipeline.execute, [0]

    async def execute(self, raise_on_error: bool = True):
        result = await real(self, raise_on_error)
        if lost[0] < times:
            lost[0] += 1
            raise RedisConnectionError("Connection closed by server.")
        return result

    monkeypatch.setattr(Pipeline, "execute", execute)
    return lost


def test_a_lost_exec_reply_counts_the_ask_once(url, monkeypatch):
    async def main():
        ledger = RedisLedger(url)
        lost = lose_exec_replies(monkeypatch)
        [(lease, refusal, quota)] = await ledger.acquire_many([("t", ONE, 300)])
        assert lost == [1] and refusal is None and lease
        data = stored(url, "t")
        assert list(data["leases"]) == [lease]  # one lease, not two
        assert quota.tokens[1] == 700 and await ledger.remaining("t") == {
            "tokens_per_day": 700}  # drawn once
        await ledger.release_many([("t", lease, 300, 100)])
        [(_, refusal, _)] = await ledger.acquire_many([("t", ONE, 100)])
        assert refusal is None  # the slot is free: no phantom lease holding it for an hour
    asyncio.run(main())


def test_a_lost_reply_of_a_settlement_settles_once(url, monkeypatch):
    async def main():
        ledger = RedisLedger(url)
        [(lease, _, _)] = await ledger.acquire_many([("t", ONE, 300)])
        lose_exec_replies(monkeypatch)
        await ledger.release_many([("t", lease, 300, 100)])
        assert await ledger.remaining("t") == {"tokens_per_day": 900}
        assert stored(url, "t")["leases"] == {}
    asyncio.run(main())


def test_watch_errors_are_retried_a_bounded_number_of_times_with_back_off(url, monkeypatch):
    """Before retry ``n`` (1 to ``MAX_WATCH_RETRIES``) the ledger sleeps a jittered
    ``uniform(0, min(BACKOFF_S * 2**n, MAX_BACKOFF_S))`` s: 2, 4, 8, 16 ms, then 32 ms
    each, about 0.2 s in all. The jitter is pinned to its top so the sleeps are exact."""
    attempts, bounds, slept = [], [], []
    real_sleep = asyncio.sleep

    async def busy(self, raise_on_error: bool = True):
        attempts.append(time.monotonic())
        await self.reset()
        raise WatchError("Watched variable changed.")

    def top_of(low: float, high: float) -> float:
        bounds.append((low, high))
        return high

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(seconds)

    monkeypatch.setattr(Pipeline, "execute", busy)
    monkeypatch.setattr(redis_ledger, "random", SimpleNamespace(uniform=top_of))
    monkeypatch.setattr(redis_ledger, "asyncio", SimpleNamespace(sleep=sleep))

    async def main():
        ledger = RedisLedger(url)
        t0 = time.monotonic()
        with pytest.raises(WatchError):
            await asyncio.wait_for(ledger.acquire_many([("t", ONE, 10)]), 5)
        return time.monotonic() - t0

    took = asyncio.run(main())
    assert (redis_ledger.MAX_WATCH_RETRIES, redis_ledger.BACKOFF_S,
            redis_ledger.MAX_BACKOFF_S) == (10, 0.001, 0.032)
    assert len(attempts) == 11  # the first attempt and 10 retries, then it gives up
    assert [high for _, high in bounds] == [0.002, 0.004, 0.008, 0.016] + [0.032] * 6
    assert {low for low, _ in bounds} == {0}  # jittered from 0
    assert slept == [high for _, high in bounds]
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert all(gap >= delay for gap, delay in zip(gaps, slept)), (gaps, slept)
    assert sum(slept) == pytest.approx(0.222)
    assert 0.222 <= took < 1.0  # the back-offs' sum, far under the router's patience


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_a_key_that_stays_busy_gives_the_tenant_its_fail_mode(url, monkeypatch, mode):
    async def busy(self, raise_on_error: bool = True):
        await self.reset()
        raise WatchError("Watched variable changed.")

    monkeypatch.setattr(Pipeline, "execute", busy)
    monkeypatch.setattr("serve_app.tenancy.limits.SHARED_TIMEOUT_S", 2.0)

    async def main():
        limiter = TenantLimiter(shared=RedisLedger(url))
        t = tenant(max_concurrent_requests=1, limits_fail_mode=mode)
        t0 = time.monotonic()
        if mode == "open":
            assert (await limiter.acquire(t)).shared is None  # counted on this router
        else:
            with pytest.raises(MeshError) as e:
                await limiter.acquire(t)
            assert (e.value.status, e.value.code) == (503, "limits_unavailable")
        # The ledger gave up (not the router's 2 s patience running out on an endless loop).
        assert time.monotonic() - t0 < 1.0
    asyncio.run(main())


def test_one_tenant_s_error_fails_its_asks_only(url):
    async def main():
        ledger = RedisLedger(url)
        answers = await ledger.acquire_many([("a", ONE, 10), ("huge", Limits(
            tokens_per_day=10**400), 10), ("b", ONE, 10)])
        assert [type(a).__name__ for a in answers] == ["tuple", "AskFailed", "tuple"]
        assert len(stored(url, "a")["leases"]) == len(stored(url, "b")["leases"]) == 1
        assert not stored(url, "huge").get("leases")
    asyncio.run(main())
