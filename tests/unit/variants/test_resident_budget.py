"""Unit tests of the resident budget: the autoscaling policy that holds a variant's last
replica until it may go (Serve's real AutoscalingContext and default policy), and the
router's choice and wait when a cold start needs room (the real availability view and cold
starts; Serve's status and the replicas faked). The real thing runs in
tests/integration/test_scale_to_zero.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

import serve_app.variants.serve_view as serve_view
import serve_app.variants.resident_budget as resident_budget
from serve_app.common.errors import MeshError
from serve_app.control.resident_policy import (EVICTED, IDLE_S, IN_FLIGHT, POLICY_FUNCTION,
                                               resident_budget_policy)
from serve_app.variants.availability import VariantAvailability
from serve_app.variants.cold_start import ColdStarts
from serve_app.variants.resident_budget import ResidentBudget

from tests.support.fake_engine import FakeEngine, replica_server
from tests.support.fakes import INFO, status_of

DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="v1")
REPLICA = ReplicaID(unique_id="r1", deployment_id=DEPLOYMENT)


def context(reports: dict[str, float] | None, *, replicas: int = 1, requests: float = 0.0,
            delay_s: float = 30.0) -> AutoscalingContext:
    """Serve's context for one deployment whose replica reported ``reports`` (None: has not
    reported yet), with ``requests`` ongoing over the look-back window."""
    config = AutoscalingConfig(min_replicas=0, max_replicas=2, target_ongoing_requests=8,
                               downscale_delay_s=delay_s, downscale_to_zero_delay_s=1)
    running = [REPLICA] if replicas else []
    raw = {name: {REPLICA: [TimeStampedValue(1.0, 0.0), TimeStampedValue(2.0, value)]}
           for name, value in (reports or {}).items()} if replicas else {}
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name="LLMReplica", app_name="v1",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=running,
        total_num_requests=requests, total_queued_requests=0.0, aggregated_metrics={},
        raw_metrics=raw, capacity_adjusted_min_replicas=0, capacity_adjusted_max_replicas=2,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=config)


def report(in_flight=0.0, idle_s=0.0, evicted=0.0) -> dict[str, float]:
    return {IN_FLIGHT: in_flight, IDLE_S: idle_s, EVICTED: evicted}


@pytest.mark.parametrize("reports,requests,want", [
    (report(idle_s=5), 0.0, 1),                      # idle, but not for downscale_delay_s
    (report(idle_s=31), 0.0, 0),                     # idle past downscale_delay_s: it goes
    (report(idle_s=0.5, evicted=1), 0.0, 0),         # evicted and idle: it goes at once
    (report(idle_s=0.5, evicted=1), 0.4, 1),         # requests in Serve's look-back window:
                                                     # at zero, Serve would start it again
    (report(in_flight=1, evicted=1), 0.0, 1),        # a request in flight (another
                                                     # router's, Serve's window empty): never
    (None, 0.0, 1),                                  # no report yet (just started): it stays
])
def test_the_policy_holds_the_last_replica_until_it_may_go(reports, requests, want):
    desired, _ = resident_budget_policy(context(reports, requests=requests))
    assert desired == want


def test_the_policy_leaves_scale_up_to_serve():
    desired, _ = resident_budget_policy(context(report(in_flight=8), requests=16))
    assert desired == 2  # Serve's own policy: 16 ongoing / 8 per replica
    desired, _ = resident_budget_policy(context(None, replicas=0, requests=3))
    assert desired >= 1  # Serve's cold-start path


def details_of(evictable: set[str], zero: set[str]) -> dict:
    """The controller's deployment details: apps with min_replicas 0, some with the policy."""
    def scaling(name):
        policy = {"policy": {"policy_function": POLICY_FUNCTION}} if name in evictable else {}
        return {"min_replicas": 0, "max_replicas": 1, **policy}
    return {"applications": {name: {"deployments": {"LLMReplica": {"deployment_config": {
        "autoscaling_config": scaling(name)}}}} for name in zero}}


class Replicas:
    """Variants' handles: ``evict()`` stops the replica (as the policy then makes Serve do)
    unless the app is in ``stubborn``; ``serving_info`` on a stopped app starts it."""

    def __init__(self, apps: dict[str, dict]):
        self.apps = apps
        self.evicted: list[str] = []  # evict() calls
        self.kept: list[str] = []  # evict(0) calls: the eviction was given up
        self.info_calls: list[str] = []  # serving_info calls (a poll, or a wake)
        self.stubborn: set[str] = set()

    def __call__(self, application):
        async def evict(for_s=60.0):
            if not for_s:
                self.kept.append(application)
                return
            self.evicted.append(application)
            if application not in self.stubborn:
                self.apps[application] = {}

        async def serving_info():
            self.info_calls.append(application)
            self.apps[application] = {"RUNNING": 1}
            return INFO
        return SimpleNamespace(evict=SimpleNamespace(remote=evict),
                               serving_info=SimpleNamespace(remote=serving_info))


@pytest.fixture
def budget(monkeypatch):
    """a, b, c scale to zero with the resident policy; d scales to zero without it. Budget
    of one; a runs."""
    apps = {"a": {"RUNNING": 1}, "b": {}, "c": {}, "d": {}}
    monkeypatch.setattr(serve_view.serve, "status", lambda: status_of(apps))
    monkeypatch.setattr(serve_view, "serve_details",
                        lambda: details_of({"a", "b", "c"}, {"a", "b", "c", "d"}))
    monkeypatch.setattr(resident_budget, "EVICT_CHECK_S", 0.01)
    replicas = Replicas(apps)
    view = VariantAvailability(replicas)
    busy: set[str] = set()
    evictions = []
    metrics = SimpleNamespace(evictions=SimpleNamespace(
        inc=lambda n, tags: evictions.append((tags["variant"], tags["outcome"]))))
    b = ResidentBudget(replicas, view, busy.__contains__, metrics)
    b.configure(1, evict_timeout_s=0.5)
    return SimpleNamespace(budget=b, view=view, replicas=replicas, apps=apps, busy=busy,
                           evictions=evictions,
                           cold_starts=ColdStarts(replicas, view, budget=b))


def test_a_cold_start_past_the_budget_evicts_the_idle_variant_first(budget):
    async def main():
        await budget.view.refresh()
        await budget.cold_starts.wake("b")
        assert budget.replicas.evicted == ["a"] and budget.evictions == [("a", "stopped")]
        assert budget.apps == {"a": {}, "b": {"RUNNING": 1}, "c": {}, "d": {}}
        assert budget.view.state("b") == "warm" and not budget.view.evicting
        assert budget.budget.status() == {"max_variants": 1, "resident": ["b"],
                                          "evicting": []}
    asyncio.run(main())


def test_the_least_recently_used_idle_variant_goes_and_a_busy_one_never(budget):
    async def main():
        budget.budget.configure(2, evict_timeout_s=0.5)
        budget.apps.update(a={"RUNNING": 1}, b={"RUNNING": 1})
        await budget.view.refresh()
        budget.view.used("b")
        budget.view.used("a")  # b is the least recently used
        await budget.budget.make_room("c")
        assert budget.replicas.evicted == ["b"]
        budget.apps.update(b={"RUNNING": 1}, c={})
        budget.busy.add("b")  # b has a request in flight here: a goes, though used later
        await budget.view.refresh()
        await budget.budget.make_room("c")
        assert budget.replicas.evicted == ["b", "a"]
    asyncio.run(main())


def test_with_nothing_evictable_the_cold_start_is_refused_with_retry_after(budget):
    async def main():
        await budget.view.refresh()
        budget.busy.add("a")
        with pytest.raises(MeshError) as e:
            await budget.cold_starts.wake("b")
        assert e.value.status == 503 and e.value.code == "resident_budget_full"
        assert e.value.headers["Retry-After"] == "10"
        assert "none may be evicted: a has requests in flight or queued" in e.value.message
        assert budget.replicas.evicted == [] and budget.apps["a"] == {"RUNNING": 1}
        budget.busy.clear()
        budget.apps.update(a={}, d={"RUNNING": 1})  # d runs without the policy: not evictable
        await budget.view.refresh()
        with pytest.raises(MeshError, match="d does not use the resident-budget autoscaling"):
            await budget.budget.make_room("b")
    asyncio.run(main())


def test_an_eviction_that_does_not_stop_in_time_refuses_and_serves_the_victim_again(budget):
    async def main():
        await budget.view.refresh()
        budget.view.used("a")  # in use: polled, but not while it is being evicted
        budget.replicas.stubborn.add("a")  # e.g. a request from another router runs there
        with pytest.raises(MeshError, match="did not stop within evict_timeout_s"):
            await budget.budget.make_room("b")
        # One poll in make_room's refresh before the eviction began, none in its ~50 status
        # checks after (a poll that arrived once it stopped would wake it).
        assert budget.replicas.info_calls == ["a"]
        await budget.view.refresh()
        assert budget.replicas.info_calls == ["a", "a"]  # it stays: polled again
        assert budget.evictions == [("a", "timed_out")] and budget.replicas.kept == ["a"]
        assert budget.view.is_available("a") and not budget.view.evicting
    asyncio.run(main())


def test_a_request_for_the_victim_during_its_eviction_does_not_stop_the_eviction(budget):
    async def main():
        await budget.view.refresh()
        budget.replicas.stubborn.add("a")  # it takes a few status checks to stop
        room = asyncio.ensure_future(budget.budget.make_room("b"))
        await asyncio.sleep(0.05)
        assert budget.view.is_asleep("a") and not budget.view.is_available("a")
        budget.view.waking.add("a")  # a request for it waits to wake it again
        budget.apps["a"] = {}
        await room  # a has no replica: b may start
        assert budget.evictions == [("a", "stopped")]
    asyncio.run(main())


def test_a_variant_whose_replica_is_stopping_is_waited_for_not_refused(budget):
    async def main():
        budget.apps["a"] = {"STOPPING": 1}  # e.g. idle past downscale_delay_s
        await budget.view.refresh()
        room = asyncio.ensure_future(budget.budget.make_room("b"))
        await asyncio.sleep(0.05)
        assert not room.done()  # it waits for a to be gone
        budget.apps["a"] = {}
        await room
        assert budget.replicas.evicted == [] and budget.evictions == []  # nothing evicted
    asyncio.run(main())


def test_a_variant_that_runs_needs_no_room(budget):
    async def main():
        budget.apps["b"] = {"RUNNING": 1}  # e.g. its own eviction gave up: it stays
        await budget.view.refresh()
        await budget.budget.make_room("b")  # two resident, but b takes nothing new
        assert budget.replicas.evicted == []
    asyncio.run(main())


def test_a_replicas_eviction_lapses_and_can_be_undone():
    from serve_app.server.serving import EngineAnswer

    s = replica_server(FakeEngine(EngineAnswer("{}")))
    assert s.autoscaling_stats()[EVICTED] == 0.0
    s.evict(60.0)
    assert s.autoscaling_stats()[EVICTED] == 1.0
    s.evict(0.0)  # the router gave up
    assert s.autoscaling_stats()[EVICTED] == 0.0
    s.evict(0.01)
    time.sleep(0.05)
    assert s.autoscaling_stats()[EVICTED] == 0.0  # lapsed: a router that died leaves nothing
    stats = s.autoscaling_stats()
    assert stats[IN_FLIGHT] == 0.0 and stats[IDLE_S] > 0.0


def test_one_eviction_never_holds_up_another_cold_start(budget):
    """Issue 28: while b's cold start waits for a's eviction (a takes its time to stop), a
    request for d, which already runs, needs no room and is not held behind that eviction;
    a cold start of c meanwhile is refused at once, since a is already spoken for and b is
    waking (the budget is one)."""
    async def main():
        budget.apps["d"] = {"RUNNING": 1}
        budget.budget.configure(2, evict_timeout_s=5.0)
        budget.apps["b"] = {}
        await budget.view.refresh()
        budget.replicas.stubborn.add("a")  # a takes a while to stop
        budget.view.waking.add("b")  # as ColdStarts.wake does
        room_b = asyncio.ensure_future(budget.budget.make_room("b"))
        await asyncio.sleep(0.05)
        assert not room_b.done() and budget.view.evicting == {"a"}
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(budget.budget.make_room("d"), 1.0)  # runs: no room needed
        budget.view.waking.add("c")
        with pytest.raises(MeshError, match="resident_budget|budget of 2"):
            await asyncio.wait_for(budget.budget.make_room("c"), 1.0)
        quick = asyncio.get_running_loop().time() - t0
        budget.apps["a"] = {}  # a stopped: b goes on
        await asyncio.wait_for(room_b, 2.0)
        return quick

    assert asyncio.run(main()) < 1.0
