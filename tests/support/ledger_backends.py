"""Both ledger backends, as the contract tests run them (``tests/unit/tenancy/test_ledger.py``,
``tests/unit/tenancy/test_lease_keeper.py``): the same routers against either.

``actor``: the :class:`KeptCounts` the Ray actor runs, called in-process over a key-value
store (the Ray actor itself, killed and restarted by Ray, is in
``tests/integration/test_tenant_token_budgets.py``). ``redis``: :class:`RedisLedger` against a
real ``redis-server`` (Debian's, ``scripts/install_services.sh``) on 127.0.0.1, killed with
SIGKILL and started again on its data directory. Either may run on a :class:`FakeClock`.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from bench.servers import start_redis
from serve_app.common.errors import MeshError
from serve_app.tenancy.ledger import KeptCounts
from serve_app.tenancy.redis_ledger import RedisLedger
from tests.support.clocks import FakeClock


class InProcessLedger:
    """A :class:`Ledger` over the :class:`KeptCounts` the backend runs now, as
    ``ActorLedger`` is over the actor (its handle reaches the actor's new incarnation)."""

    backend = "actor"

    def __init__(self, actor: ActorBackend) -> None:
        self.actor = actor

    @property
    def kept(self) -> KeptCounts:
        if self.actor.down:
            raise ConnectionError("the ledger actor is down")
        return self.actor.kept

    async def acquire_many(self, asks):
        await asyncio.sleep(0.001)  # a call's round trip: asks from both routers interleave
        return self.kept.acquire_many(asks)

    async def release_many(self, releases):
        self.kept.release_many(releases)

    async def renew_many(self, renewals):
        await asyncio.sleep(0.001)
        return self.kept.renew_many(renewals)

    async def ping(self):
        pass

    async def remaining(self, tenant_id):
        return self.kept.remaining(tenant_id)


class ActorBackend:
    name = "actor"

    def __init__(self, tmp_path, clock: FakeClock | None = None) -> None:
        self.store: dict[str, str] = {}  # tenant id -> JSON, as the GCS keeps it
        self.clock = clock
        self.down = False
        self.restart()

    def client(self) -> InProcessLedger:
        return InProcessLedger(self)

    def restart(self) -> None:
        """The actor dies and Ray starts it again: a new incarnation reads the store."""
        self.kept = KeptCounts(lambda: dict(self.store), self.store.__setitem__,
                               **({"clock": self.clock} if self.clock else {}))

    def stop(self) -> None:
        pass

    def take_down(self) -> None:
        """The ledger stops answering (its node is lost)."""
        self.down = True


class RedisBackend:
    name = "redis"

    def __init__(self, tmp_path, clock: FakeClock | None = None) -> None:
        self.dir = str(tmp_path)
        self.clock = clock
        self.proc, self.url = start_redis(self.dir)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def client(self) -> RedisLedger:
        return RedisLedger(self.url, clock=self.clock)

    def restart(self) -> None:
        """The server is killed (SIGKILL) and started again on its data directory."""
        self.proc.kill()
        self.proc.wait()
        self.proc, _ = start_redis(self.dir, port=self.port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def take_down(self) -> None:
        self.stop()


BACKENDS = {"actor": ActorBackend, "redis": RedisBackend}


@pytest.fixture(params=list(BACKENDS))
def backend(request, tmp_path):
    """Each backend in turn, on the real clock."""
    b = BACKENDS[request.param](tmp_path)
    yield b
    b.stop()


@pytest.fixture(params=list(BACKENDS))
def clocked(request, tmp_path):
    """Each backend in turn, on a :class:`FakeClock` (``clocked.clock``)."""
    b = BACKENDS[request.param](tmp_path, FakeClock(1_000_000.0))
    yield b
    b.stop()


class CountingLedger:
    """``ledger``'s calls, counted by method name (``calls``)."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger
        self.backend = ledger.backend
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name):
        method = getattr(self.ledger, name)

        async def counted(*args):
            self.calls[name] += 1
            return await method(*args)
        return counted

    def asks(self) -> int:
        """Calls a request makes without a lease: asks and settlements."""
        return self.calls["acquire_many"] + self.calls["release_many"]


async def granted(limiter, tenant, tokens: int):
    """``limiter.acquire(tenant, tokens)``: the request counted, or None when refused with a
    429 (any other refusal fails the test)."""
    try:
        return await limiter.acquire(tenant, tokens)
    except MeshError as e:
        assert e.status == 429, e.body()
        return None
