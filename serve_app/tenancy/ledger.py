"""The ledger: where the tenant counts of every router replica are kept, and kept safe.

A router's :class:`~serve_app.tenancy.limits.TenantLimiter` asks a
:class:`~serve_app.tenancy.ledger_protocol.Ledger` to count each request of a limited tenant
and to settle it when it ends. Two backends, chosen by the router's ``user_config``
(``ledger:``, :class:`~serve_app.common.config.LedgerConfig`):

- ``actor`` (the default): one named, detached Ray actor, :class:`SharedTenantCounts`. It
  writes the token buckets of each tenant a call changed to the Ray GCS key-value store
  before that call answers, and reads them back when Ray restarts it, so a crash gives no
  budget back. A tenant's counts are committed only once written; a tenant whose counting
  or write fails is put back as it was and its asks answer :class:`AskFailed`, the call's
  other tenants are answered as usual. The GCS itself is lost with the head node unless
  Ray runs with GCS fault tolerance (an external Redis); in-flight counts start from zero
  in a new incarnation (their requests settle their tokens all the same).
- ``redis``: :class:`~serve_app.tenancy.redis_ledger.RedisLedger`, the counts in a Redis
  server, as Envoy's rate-limit service and LiteLLM keep theirs: survives the whole Ray
  cluster, and in-flight counts are leases that expire should a router die holding one.

Both run the same counting (:class:`~serve_app.tenancy.counts.TenantCounts`) and pass the
same contract tests (``tests/unit/tenancy/test_ledger.py``), budget leases included: a router
replica renews its leases on busy tenants' budgets in one :meth:`Ledger.renew_many` call about
once a second (:mod:`serve_app.tenancy.lease_terms`) and spends them with no call per request. A
lease is kept with its tenant's buckets (saved, read back after a restart) and expires
:data:`~serve_app.tenancy.lease_terms.BUDGET_LEASE_TTL_S` after its last renewal.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import ray
from ray.experimental.internal_kv import (_internal_kv_get, _internal_kv_list,
                                         _internal_kv_put)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.common.logs import get_logger
from serve_app.tenancy.counts import TenantCounts
from serve_app.tenancy.ledger_protocol import (Answer, Ask, AskFailed, Ledger, Release, by_tenant,
                                              count_by_tenant)
from serve_app.tenancy.lease_terms import Grant, Renewal

logger = get_logger(__name__)

#: The shared counts' actor: name and namespace (one per Ray cluster). The actor is detached:
#: it outlives `serve shutdown`, so its name carries the version of its calls' protocol, and
#: routers of a new version never call an older actor (3: settles across incarnations, kept
#: in the GCS; 4: budget leases).
SHARED_NAME, SHARED_NAMESPACE = "mesh-tenant-counts-4", "model-mesh"
#: Where the actor keeps its buckets (Ray's internal key-value store, in the GCS): one key
#: per tenant, the prefix followed by the tenant id.
KV_PREFIX, KV_NAMESPACE = b"tenant-ledger/", b"model-mesh"


class KeptCounts:
    """A :class:`TenantCounts` kept in a key-value store, one entry per tenant: its buckets
    are read back when it starts, and each tenant a call changed is written before that call
    answers.

    ``incarnation`` is new at each start: in-flight counts start from zero then, so a
    release meant for an earlier incarnation settles its tokens but frees no slot.

    Args:
        read_all: returns every entry written so far, tenant id -> JSON (str or bytes).
        write: stores one tenant's JSON, ``write(tenant_id, json)``.
    """

    def __init__(self, read_all: Callable[[], dict[str, bytes | str]],
                 write: Callable[[str, str], None], clock: Callable[[], float] = time.time
                 ) -> None:
        self.counts = TenantCounts(clock=clock)  # wall clock: a restart may move nodes
        self.incarnation = uuid.uuid4().hex
        self._write = write
        saved = read_all()
        for tenant_id, data in saved.items():
            self.counts.load(tenant_id, json.loads(data))
        if saved:
            logger.info("tenant ledger: buckets of %d tenants read back", len(saved))

    def _save(self, tenant_id: str) -> None:
        self._write(tenant_id, json.dumps(self.counts.export(tenant_id)))

    def acquire_many(self, asks: list[Ask]) -> list[Answer | AskFailed]:
        """:meth:`TenantCounts.acquire` for each ask, tenant by tenant, each tenant's counts
        saved before the call answers and committed only once saved: a tenant whose
        counting or saving raises is left as it was and its asks answer :class:`AskFailed`,
        so one tenant's failure neither fails the others' asks nor leaves counts that no
        request holds (the next request would get 429 until a restart)."""
        return count_by_tenant(
            self.counts, asks, lambda i: (self.incarnation, *self.counts.acquire(*asks[i])),
            self._save)

    def renew_many(self, renewals: list[Renewal]) -> list[Grant | AskFailed]:
        """:meth:`TenantCounts.renew` for each, tenant by tenant, saved before the call
        answers and committed only once saved (as :meth:`acquire_many`)."""
        return count_by_tenant(self.counts, renewals,
                               lambda i: self.counts.renew(renewals[i]), self._save,
                               what="lease renewals")

    def release_many(self, releases: list[Release]) -> None:
        """:meth:`TenantCounts.release` for each, tenant by tenant, saved: one tenant's
        failure is logged and the others are still settled."""
        for tenant_id, indices in by_tenant(releases).items():
            try:
                for i in indices:
                    _, incarnation, reserved, used = releases[i]
                    self.counts.release(tenant_id, reserved, used,
                                        counted=incarnation == self.incarnation)
                self._save(tenant_id)
            except Exception as e:  # noqa: BLE001 - that tenant's settlements only
                logger.warning("tenant ledger: settlements of tenant %r not saved (%s: %s)",
                               tenant_id, type(e).__name__, str(e)[:200])

    def in_flight(self, tenant_id: str) -> int:
        return self.counts.in_flight(tenant_id)

    def remaining(self, tenant_id: str) -> dict[str, int]:
        return self.counts.remaining(tenant_id)


@ray.remote(num_cpus=0, max_restarts=-1)
class SharedTenantCounts(KeptCounts):
    """The cluster's one :class:`KeptCounts` (a Ray actor: calls run one at a time), kept in
    the Ray GCS's key-value store (module docstring)."""

    def __init__(self) -> None:
        super().__init__(_read_kept, lambda tenant_id, data: _internal_kv_put(
            KV_PREFIX + tenant_id.encode(), data, overwrite=True, namespace=KV_NAMESPACE))


def _read_kept() -> dict[str, bytes]:
    """Every tenant the actor kept in the GCS key-value store, id -> JSON."""
    keys = _internal_kv_list(KV_PREFIX, namespace=KV_NAMESPACE)
    return {key[len(KV_PREFIX):].decode(): _internal_kv_get(key, namespace=KV_NAMESPACE)
            for key in keys}


class ActorLedger:
    """:class:`Ledger` over the :class:`SharedTenantCounts` actor ``handle``."""

    backend = "actor"

    def __init__(self, handle) -> None:
        self.handle = handle

    async def acquire_many(self, asks: list[Ask]) -> list[Answer | AskFailed]:
        return await self.handle.acquire_many.remote(asks)

    async def release_many(self, releases: list[Release]) -> None:
        await self.handle.release_many.remote(releases)

    async def ping(self) -> None:
        await self.handle.in_flight.remote("")

    async def remaining(self, tenant_id: str) -> dict[str, int]:
        return await self.handle.remaining.remote(tenant_id)

    async def renew_many(self, renewals: list[Renewal]) -> list[Grant | AskFailed]:
        return await self.handle.renew_many.remote(renewals)


def shared_tenant_counts():
    """The cluster's :class:`SharedTenantCounts` actor handle. The first router to ask
    creates it on its own node (soft affinity: a node of routers, not one that runs engines
    only); Ray restarts it elsewhere if that node is lost."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return SharedTenantCounts.options(name=SHARED_NAME, namespace=SHARED_NAMESPACE,
                                      lifetime="detached", get_if_exists=True,
                                      scheduling_strategy=here).remote()


def ledger_for(config) -> Ledger:
    """The :class:`Ledger` a :class:`~serve_app.common.config.LedgerConfig` names (None:
    the default actor)."""
    if config is not None and config.backend == "redis":
        from serve_app.tenancy.redis_ledger import RedisLedger
        return RedisLedger(config.redis_url)
    return ActorLedger(shared_tenant_counts())
