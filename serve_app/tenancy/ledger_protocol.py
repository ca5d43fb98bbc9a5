"""What a router asks of a ledger and how every backend answers: the calls' items
(:data:`Ask`, :data:`Answer`, :data:`Release`), :class:`AskFailed`, the :class:`Ledger`
protocol both backends implement (the Ray actor of :mod:`serve_app.tenancy.ledger`, the Redis
server of :mod:`serve_app.tenancy.redis_ledger`), and :func:`count_by_tenant`, how each
counts a call's items tenant by tenant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from serve_app.common.logs import get_logger
from serve_app.tenancy.counts import Refusal, TenantCounts
from serve_app.tenancy.lease_terms import Grant, Renewal
from serve_app.tenancy.quota import Limits, Quota

logger = get_logger(__name__)

#: A request to count: ``(tenant_id, limits, tokens reserved)``.
Ask = tuple[str, Limits, int]
#: A ledger's answer: ``(lease, refusal or None, quota)``; ``lease`` identifies the count
#: for its release (the actor's incarnation, a Redis lease id).
Answer = tuple[str, Refusal | None, Quota]
#: A settlement: ``(tenant_id, lease, tokens reserved, tokens used)``.
Release = tuple[str, str, int, int]


class AskFailed(Exception):
    """The answer, in :meth:`Ledger.acquire_many`'s list, to an ask the ledger could not count
    (its tenant's counts could not be saved, or counting them raised): nothing of it is
    counted, the batch's other asks are answered as usual, and the router applies that
    tenant's ``limits_fail_mode`` to that request alone."""


def tenant_of(item: tuple | Renewal) -> str:
    """The tenant id of an ask, a release or a :class:`Renewal`."""
    return item.tenant_id if isinstance(item, Renewal) else item[0]


def by_tenant(items: list) -> dict[str, list[int]]:
    """Indices of ``items`` (asks, releases or renewals) per tenant, in order."""
    out: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        out.setdefault(tenant_of(item), []).append(i)
    return out


def count_by_tenant(counts: TenantCounts, items: list, count: Callable[[int], Any],
                    commit: Callable[[str], None] = lambda tenant_id: None,
                    what: str = "asks") -> list:
    """``count(i)`` for each item, tenant by tenant, then ``commit(tenant_id)`` (a save); a
    tenant whose counting or commit raises is put back as it was and each of its items
    answers :class:`AskFailed`, the other tenants' are answered as usual."""
    answers: list = [AskFailed("not counted")] * len(items)
    for tenant_id, indices in by_tenant(items).items():
        try:
            with counts.all_or_nothing(tenant_id):
                counted = [(i, count(i)) for i in indices]
                commit(tenant_id)
        except Exception as e:  # noqa: BLE001 - that tenant's items only
            logger.warning("tenant ledger: %d %s of tenant %r not counted (%s: %s)",
                           len(indices), what, tenant_id, type(e).__name__, str(e)[:200])
            for i in indices:
                answers[i] = AskFailed(f"tenant {tenant_id!r}: {type(e).__name__}")
            continue
        for i, answer in counted:
            answers[i] = answer
    return answers


class Ledger(Protocol):
    """The cluster's tenant counts, as a router calls them (every call may raise: the
    router then applies the tenant's ``limits_fail_mode``)."""

    backend: str

    async def acquire_many(self, asks: list[Ask]) -> list[Answer | AskFailed]:
        """Count each ask in order (:meth:`TenantCounts.acquire`); one answer each, or
        :class:`AskFailed` for an ask of a tenant the ledger could not count (raises only
        when it cannot answer at all)."""

    async def release_many(self, releases: list[Release]) -> None:
        """Settle each ended request (:meth:`TenantCounts.release`)."""

    async def ping(self) -> None:
        """Return once the ledger answers."""

    async def remaining(self, tenant_id: str) -> dict[str, int]:
        """Tokens (or requests) the tenant has left per bucket, now, beyond what budget
        leases hold."""

    async def renew_many(self, renewals: list[Renewal]) -> list[Grant | AskFailed]:
        """Apply each router's :class:`Renewal` of a budget lease
        (:meth:`TenantCounts.renew`); one :class:`Grant` each, or :class:`AskFailed` for a
        tenant the ledger could not count (raises only when it cannot answer at all)."""
