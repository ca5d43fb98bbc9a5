"""The actor ledger commits a tenant's counts only once they are saved, and one tenant's
failure is that tenant's alone (no Ray: the actor's :class:`KeptCounts` over a fake
key-value store, and a router's limiter calling it as the actor's handle would).

Before, ``acquire_many`` counted every ask of a batch and then saved: one failure (a KV
write, or another tenant's limits that overflow) failed the whole batch and left every ask
in it counted, so the next request got 429 ``concurrency_limit_exceeded`` until the actor
restarted.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_app.tenancy.ledger import KeptCounts
from serve_app.tenancy.limits import TenantLimiter
from serve_app.tenancy.quota import Limits
from tests.support.tenants import tenant

ONE = Limits(max_concurrent_requests=1, tokens_per_day=1000)
OVERFLOWING = Limits(tokens_per_day=10**400)  # float(limit) raises OverflowError


class Store:
    """The GCS key-value store, failing the writes of the tenants in ``failing``."""

    def __init__(self) -> None:
        self.saved: dict[str, str] = {}
        self.failing: set[str] = set()

    def write(self, tenant_id: str, data: str) -> None:
        if tenant_id in self.failing:
            raise ConnectionError("GCS unavailable")
        self.saved[tenant_id] = data


def kept() -> tuple[KeptCounts, Store]:
    store = Store()
    return KeptCounts(lambda: {}, store.write), store


def test_a_failed_save_counts_nothing_of_that_tenant_and_the_rest_of_the_batch_is_answered():
    ledger, store = kept()
    store.failing.add("bad")
    answers = ledger.acquire_many([("good", ONE, 100), ("bad", ONE, 100), ("good2", ONE, 50)])
    assert isinstance(answers[1], Exception)  # AskFailed
    assert answers[0][1] is None and answers[2][1] is None  # counted, not refused
    assert ledger.in_flight("bad") == 0 and ledger.remaining("bad") == {}
    assert (ledger.in_flight("good"), ledger.in_flight("good2")) == (1, 1)
    assert set(store.saved) == {"good", "good2"}
    store.failing.clear()
    # No phantom count: the next request of the 1-in-flight tenant is counted, not a 429.
    [(_, refusal, _)] = ledger.acquire_many([("bad", ONE, 100)])
    assert refusal is None and ledger.in_flight("bad") == 1


def test_a_failure_leaves_a_tenant_s_earlier_state_as_it_was():
    ledger, store = kept()
    ledger.acquire_many([("t", Limits(max_concurrent_requests=5, tokens_per_day=1000), 300)])
    before = (ledger.in_flight("t"), ledger.remaining("t"))
    store.failing.add("t")
    answers = ledger.acquire_many([("t", Limits(max_concurrent_requests=5,
                                                tokens_per_day=1000), 200)] * 3)
    assert all(isinstance(a, Exception) for a in answers)
    assert (ledger.in_flight("t"), ledger.remaining("t")) == before


def test_another_tenant_s_overflowing_limits_fail_its_asks_only():
    ledger, _ = kept()
    answers = ledger.acquire_many([("a", ONE, 10), ("huge", OVERFLOWING, 10), ("b", ONE, 10)])
    assert [type(a).__name__ for a in answers] == ["tuple", "AskFailed", "tuple"]
    assert (ledger.in_flight("a"), ledger.in_flight("huge"), ledger.in_flight("b")) == (1, 0, 1)


def test_releases_of_one_tenant_failing_do_not_keep_the_others_slots():
    ledger, store = kept()
    answers = ledger.acquire_many([("a", ONE, 10), ("huge", ONE, 10), ("b", ONE, 10)])
    store.failing.add("huge")
    ledger.release_many([(t, a[0], 10, 5) for t, a in zip(("a", "huge", "b"), answers)])
    assert (ledger.in_flight("a"), ledger.in_flight("b")) == (0, 0)


class ActorHandle:
    """The actor's ledger as a router's limiter calls it (:class:`ActorLedger`)."""

    backend = "fake-actor"

    def __init__(self, ledger: KeptCounts) -> None:
        self.ledger = ledger

    async def acquire_many(self, asks):
        return self.ledger.acquire_many(asks)

    async def release_many(self, releases):
        self.ledger.release_many(releases)

    async def ping(self):
        pass


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_through_a_router_the_failed_tenant_gets_its_fail_mode_and_no_phantom_429(mode):
    async def main():
        ledger, store = kept()
        limiter = TenantLimiter(shared=ActorHandle(ledger))
        t = tenant(max_concurrent_requests=1, limits_fail_mode=mode)
        store.failing.add("t")
        if mode == "open":
            lease = await limiter.acquire(t)
            assert lease.shared is None  # counted on this router, by its fail mode
            limiter.release(lease)
        else:
            with pytest.raises(Exception) as e:
                await limiter.acquire(t)
            assert (e.value.status, e.value.code) == (503, "limits_unavailable")
        assert limiter._down_until == 0.0  # the ledger answers: others keep counting there
        store.failing.clear()
        lease = await limiter.acquire(t)
        assert lease.shared is not None and ledger.in_flight("t") == 1
    asyncio.run(main())
