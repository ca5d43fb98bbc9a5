"""Fakes at the router's edges, for unit tests without Ray: the replicas' answers through
Serve's handles (:class:`FakeStream`, :class:`FakeHandles`), the availability view, the
router's metrics (recorded, or :class:`NullMetrics`), Serve's status, and the tenant ledger."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.exceptions import RayActorError

from serve_app.common.wire import GenerateRequest, ReplicaInfo, Usage
from serve_app.request.planner import RequestPlan
from serve_app.dispatch.account import RequestAccount
from serve_app.tenancy.counts import TenantCounts
from serve_app.variants.registry import VariantRegistry


class FakeStream:
    """What ``handle.options(stream=True).generate.remote(request)`` returns."""

    def __init__(self, items, *, hang: bool = False):
        self.items, self.hang, self.cancelled = list(items), hang, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.hang:
            await asyncio.sleep(3600)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class FakeHandles:
    """Application -> the answer its replica gives; records each call's request."""

    def __init__(self, answers: dict[str, FakeStream]):
        self.answers, self.sent = answers, []

    def __call__(self, application):
        def remote(request):
            self.sent.append((application, request))
            return self.answers[application]
        return SimpleNamespace(options=lambda stream: SimpleNamespace(
            generate=SimpleNamespace(remote=remote)))


class FakeAvailability:
    """The availability view as the Dispatcher asks it: 4 slots a variant, every variant
    awake; records refreshes and lost replicas."""

    def __init__(self):
        self.lost, self.refreshed = [], 0

    def slots(self, application):
        return 4

    async def refresh(self, max_age_s=0.0):
        self.refreshed += 1

    def replica_lost(self, application):
        self.lost.append(application)

    def is_asleep(self, application):
        return False

    def may_be_asleep(self, application):
        return False

    def used(self, application):
        pass

    def serves(self, application, adapter):
        return True


class FakePlannerAvailability:
    """The availability view as the RequestPlanner asks it: the adapter versions each variant
    serves (``adapters``: application -> ``{"name@vN"}``); ``down``: asleep; ``stale``:
    asleep, but the view says warm until it is refreshed (``refreshes`` counts them)."""

    def __init__(self, adapters: dict[str, set[str]], down: set[str] = frozenset(),
                 stale: set[str] = frozenset()) -> None:
        self.adapters = adapters
        self.down = set(down)
        self.stale = set(stale)
        self.refreshes = 0

    def serves(self, application, adapter):
        versions = self.adapters.get(application, ())
        return adapter in versions if "@" in adapter else any(
            v.partition("@")[0] == adapter for v in versions)

    def prefer_available(self, candidates):
        return [c for c in candidates if c not in self.down] + [c for c in candidates
                                                                 if c in self.down]

    async def refresh(self, max_age_s=0.0):
        self.refreshes += 1
        self.down |= self.stale
        self.stale = set()

    def is_asleep(self, application):
        return application in self.down

    def may_be_asleep(self, application):
        return application in self.stale


def registry_of(handle_for, availability=None, admissions: dict | None = None
                ) -> VariantRegistry:
    """A real :class:`VariantRegistry` over fake handles and availability
    (:class:`FakeAvailability` by default), with the given admission queues (variant ->
    ``VariantAdmission``, as a test configured them) in place of fresh ones."""
    registry = VariantRegistry(handle_for=handle_for,
                               availability=availability or FakeAvailability())
    for application, queue in (admissions or {}).items():
        registry._admission[application] = queue
    return registry


class FakeRouterMetrics:
    """The router metrics a RequestAccount records to: each finished request in ``recorded``
    as ``(variant, status, error_kind)`` and in ``finished`` as ``(status, ttft_s, usage,
    error_kind)``; each failover's variant in ``failovers``."""

    def __init__(self):
        self.recorded, self.finished, self.failovers = [], [], []
        self.queue_time = SimpleNamespace(observe=lambda *a: None)
        self.rejected = SimpleNamespace(inc=lambda *a: None)
        self.failovers_counter = SimpleNamespace(
            inc=lambda n, tags: self.failovers.append(tags["variant"]))

    def record(self, tags, status, latency_s, *, ttft_s=None, prompt_tokens=0,
               completion_tokens=0, error_kind=None, **kw):
        self.recorded.append((tags["variant"], status, error_kind))
        self.finished.append((status, ttft_s, Usage(prompt_tokens, completion_tokens),
                              error_kind))

    def account(self, observe, tenant: str = "") -> RequestAccount:
        metrics = SimpleNamespace(queue_time=self.queue_time, rejected=self.rejected,
                                  failovers=self.failovers_counter, record=self.record)
        return RequestAccount(metrics, observe, {"route": "r", "variant": "", "tenant": tenant,
                                                 "adapter": ""}, "req-1")


class NullMetrics:
    """Router metrics that record nothing: every attribute, and every call, is a no-op."""

    def __getattr__(self, name):
        return NullMetrics()

    def __call__(self, *args, **kwargs):
        return None


def plan_of(candidates, queue_timeout_s=5.0, top_priority=True) -> RequestPlan:
    """A chat request's plan over ``candidates`` (route ``r``, no tenant), as the Dispatcher
    gets it."""
    request = GenerateRequest("chat", {"model": "r", "messages": []}, priority=2,
                              request_id="req-1")
    return RequestPlan(request=request, route="r", adapter="", candidates=tuple(candidates),
                       arms=(("r", ""),), tenant=None, top_priority=top_priority,
                       queue_timeout_s=queue_timeout_s)


#: A replica serving acme@v1 with 8 engine slots.
INFO = ReplicaInfo(("acme@v1",), max_num_seqs=8)


def status_of(apps: dict[str, dict], messages: dict[str, str] | None = None):
    """serve.status() for {app: {"RUNNING": n, "STARTING": m}}, with the deployments'
    ``messages`` (the controller's words on a replica that failed to start)."""
    return SimpleNamespace(applications={
        name: SimpleNamespace(status="RUNNING", deployments={
            "LLMReplica": SimpleNamespace(replica_states=states,
                                          message=(messages or {}).get(name, ""))})
        for name, states in apps.items()})


class FakeShared:
    """A :class:`~serve_app.tenancy.ledger_protocol.Ledger` on a real TenantCounts, as the actor
    runs it, with a delay or a failure on request."""

    backend = "fake"

    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        self.counts, self.incarnation = TenantCounts(), "one"
        self.delay_s, self.fail = delay_s, fail
        self.calls = 0

    async def acquire_many(self, requests):
        self.calls += 1
        if self.fail:
            raise RayActorError()
        await asyncio.sleep(self.delay_s)
        return [(self.incarnation, *self.counts.acquire(*r)) for r in requests]

    async def release_many(self, releases):
        for tenant_id, incarnation, reserved, used in releases:
            self.counts.release(tenant_id, reserved, used,
                                counted=incarnation == self.incarnation)

    async def ping(self):
        pass
