"""Unit tests of the availability view (no Ray cluster: serve.status() and the replicas'
answers are faked): running replicas, admission slots, adapters, a redeploy's build phase."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import serve_app.variants.availability as availability
import serve_app.variants.serve_view as serve_view
from serve_app.variants.availability import VariantAvailability
from serve_app.common.wire import ReplicaInfo


@pytest.fixture(autouse=True)
def no_controller(monkeypatch):
    """Deployment details as a controller with no scale-to-zero variant gives them."""
    monkeypatch.setattr(serve_view, "serve_details", lambda: {"applications": {}})


def app(status: str, running: int | None):
    deployments = {} if running is None else {
        "LLMReplica": SimpleNamespace(replica_states={"RUNNING": running} if running else {})}
    return SimpleNamespace(status=status, deployments=deployments)


class FakeServingInfoHandle:
    """A variant's deployment handle whose ``serving_info.remote()`` answers ``info``."""

    def __init__(self, info: ReplicaInfo) -> None:
        self.serving_info = SimpleNamespace(remote=self._remote)
        self.info = info

    async def _remote(self):
        return self.info


def view(monkeypatch, apps: dict, infos: dict[str, ReplicaInfo]) -> VariantAvailability:
    monkeypatch.setattr(serve_view.serve, "status",
                        lambda: SimpleNamespace(applications=apps))
    calls = []
    v = VariantAvailability(lambda name: FakeServingInfoHandle(infos[name]),
                            on_refresh=lambda: calls.append(1))
    v.refreshes = calls
    return v


def test_slots_adapters_and_unknowns(monkeypatch):
    infos = {"v1": ReplicaInfo(("acme@v1",), max_num_seqs=8, priority_scheduling=True),
             "v2": ReplicaInfo((), max_num_seqs=4)}
    apps = {"v1": app("RUNNING", 2), "v2": app("RUNNING", 1), "v3": app("DEPLOY_FAILED", 0)}
    v = view(monkeypatch, apps, infos)
    assert v.slots("v1") is None  # nothing polled yet: unknown, not zero
    assert v.is_available("v1")
    asyncio.run(v.refresh())
    assert v.refreshes == [1, 1]  # after the status, and after the replicas' answers
    assert (v.slots("v1"), v.slots("v2"), v.slots("v3"), v.slots("absent")) == (16, 4, 0, 0)
    assert v.serves("v1", "acme") and v.serves("v1", "acme@v1") and not v.serves("v2", "acme")
    assert v.prefer_available(["v3", "v1", "v2"]) == ["v1", "v2", "v3"]


def test_a_redeploys_build_phase_keeps_the_old_replicas(monkeypatch):
    infos = {"v1": ReplicaInfo((), max_num_seqs=8)}
    apps = {"v1": app("RUNNING", 1)}
    v = view(monkeypatch, apps, infos)
    asyncio.run(v.refresh())
    assert v.slots("v1") == 8
    apps["v1"] = app("DEPLOYING", None)  # Serve lists no deployments while it builds
    asyncio.run(v.refresh())
    assert v.slots("v1") == 8 and v.is_available("v1")
    apps["v1"] = app("DEPLOY_FAILED", None)  # the build task failed: the old replica serves
    asyncio.run(v.refresh())
    assert v.slots("v1") == 8
    apps["v1"] = app("DELETING", 1)
    asyncio.run(v.refresh())
    assert v.slots("v1") == 0


def states(status: str, **replica_states: int):
    return SimpleNamespace(status=status, deployments={
        "LLMReplica": SimpleNamespace(replica_states=replica_states)})


def test_a_replica_being_reconfigured_or_replaced_in_place_still_serves(monkeypatch):
    """Issue 31: a user_config reconfigure (UPDATING) and a replacement starting after the old
    replica stopped keep a single-variant route available, with its slots, through a deploy."""
    infos = {"v1": ReplicaInfo((), max_num_seqs=8)}
    apps = {"v1": states("RUNNING", RUNNING=1)}
    v = view(monkeypatch, apps, infos)
    asyncio.run(v.refresh())
    for during in (states("DEPLOYING", UPDATING=1),  # the in-place reconfigure
                   states("DEPLOYING", STOPPING=1, STARTING=1),  # replaced, no surge
                   states("RUNNING", PENDING_MIGRATION=1)):  # on a draining node
        apps["v1"] = during
        asyncio.run(v.refresh())
        assert v.is_available("v1") and v.slots("v1") == 8, during
        assert v.prefer_available(["v1"]) == ["v1"]
    apps["v1"] = states("RUNNING", STOPPING=1, STARTING=1)  # not a deploy: a crash restart
    asyncio.run(v.refresh())
    assert not v.is_available("v1") and v.slots("v1") == 0


def test_a_new_variants_first_start_is_not_serving(monkeypatch):
    infos = {"v1": ReplicaInfo((), max_num_seqs=8), "v2": ReplicaInfo((), max_num_seqs=8)}
    v = view(monkeypatch, {"v1": states("RUNNING", RUNNING=1),
                           "v2": states("DEPLOYING", STARTING=1)}, infos)
    asyncio.run(v.refresh())
    assert not v.is_available("v2") and v.slots("v2") == 0  # nothing served there yet
    assert v.prefer_available(["v2", "v1"]) == ["v1", "v2"]


def test_admission_sees_a_new_replica_before_it_answers_the_poll(monkeypatch):
    """A variant that just started: the status says it runs while its serving_info answer
    is still on its way. The router's admission hears of it at once (capacity unknown, so a
    request goes to Serve's handle), not after the answer: a request in between got 503
    no_healthy_variant in 60 ms on a single-variant route; and not after the deployment
    details that a new status makes it read (full20: two 503s in the 20 ms such a read took
    as a deploy ended)."""
    apps = {"v1": app("DEPLOYING", 0)}
    answer = asyncio.Event()
    details_read = threading.Event()

    def slow_details():
        details_read.wait(10)
        return {"applications": {}}
    monkeypatch.setattr(serve_view, "serve_details", slow_details)

    class Slow(FakeServingInfoHandle):
        async def _remote(self):
            await answer.wait()
            return self.info
    seen = []
    monkeypatch.setattr(serve_view.serve, "status", lambda: SimpleNamespace(applications=apps))
    v = VariantAvailability(lambda name: Slow(ReplicaInfo((), 8)),
                            on_refresh=lambda: seen.append(v.slots("v1")))

    async def main():
        details_read.set()
        await v.refresh()
        details_read.clear()
        apps["v1"] = app("RUNNING", 1)  # a new status: the details are read again
        poll = asyncio.ensure_future(v.refresh())
        while not v.running("v1"):  # the status is read in a thread
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert seen[-1] is None and v.is_available("v1")  # running; slots not known yet
        details_read.set()
        answer.set()
        await poll
    asyncio.run(main())
    assert seen[-1] == 8


def test_refresh_max_age_saves_status_calls(monkeypatch):
    v = view(monkeypatch, {"v1": app("RUNNING", 1)}, {"v1": ReplicaInfo((), 8)})
    asyncio.run(v.refresh(max_age_s=10))
    asyncio.run(v.refresh(max_age_s=10))
    assert v.refreshes == [1, 1]  # one refresh: after the status, after the answers
    asyncio.run(v.refresh())
    assert v.refreshes == [1] * 4


def test_concurrent_refreshes_share_one_status_call(monkeypatch):
    calls = []

    def status():
        calls.append(1)
        return SimpleNamespace(applications={"v1": app("RUNNING", 1)})
    monkeypatch.setattr(serve_view.serve, "status", status)
    v = VariantAvailability(lambda name: FakeServingInfoHandle(ReplicaInfo((), 8)))

    async def main():
        await asyncio.gather(*(v.refresh() for _ in range(5)))
    asyncio.run(main())
    assert len(calls) == 1 and v.slots("v1") == 8


def test_a_herd_of_refreshes_behind_a_poll_shares_one_status_call(monkeypatch):
    """Issue 28: 200 requests asking for a status refresh while a poll-only refresh was under
    way recursed through asyncio.shield until a RecursionError (a 500 to 3 clients)."""
    calls = []

    def status():
        calls.append(1)
        return SimpleNamespace(applications={"v1": app("RUNNING", 1)})
    monkeypatch.setattr(serve_view.serve, "status", status)
    v = VariantAvailability(lambda name: FakeServingInfoHandle(ReplicaInfo((), 8)))

    async def main():
        await v.refresh()  # a first view, with status
        poll = asyncio.ensure_future(v.refresh(status=False))  # the poll: no status
        await asyncio.sleep(0)
        await asyncio.gather(poll, *(v.refresh() for _ in range(2000)))
    asyncio.run(main())
    assert len(calls) == 2 and v.slots("v1") == 8  # the first view, then one for the herd


def test_a_caller_waiting_behind_many_polls_does_not_recurse(monkeypatch):
    calls = []

    def status():
        calls.append(1)
        return SimpleNamespace(applications={"v1": app("RUNNING", 1)})
    monkeypatch.setattr(serve_view.serve, "status", status)
    v = VariantAvailability(lambda name: FakeServingInfoHandle(ReplicaInfo((), 8)))

    async def main():
        await v.refresh()

        async def polls():  # poll-only refreshes back to back, 1,500 (> the recursion limit)
            for _ in range(1500):
                await v.refresh(status=False)
        p = asyncio.ensure_future(polls())
        await asyncio.sleep(0)
        await v.refresh()  # wants a status: waits them out in a loop, then asks once
        await p
    asyncio.run(main())
    assert len(calls) == 2


def test_a_variant_that_lost_a_replica_is_tried_last_for_a_while(monkeypatch):
    infos = {"v1": ReplicaInfo((), max_num_seqs=8), "v2": ReplicaInfo((), max_num_seqs=8)}
    v = view(monkeypatch, {"v1": app("RUNNING", 1), "v2": app("RUNNING", 1)}, infos)
    asyncio.run(v.refresh())
    now = [1000.0]
    monkeypatch.setattr(availability.time, "monotonic", lambda: now[0])
    v.replica_lost("v2")  # the Serve status still says RUNNING: Ray has not noticed yet
    assert not v.is_available("v2") and v.prefer_available(["v2", "v1"]) == ["v1", "v2"]
    now[0] += availability.LOST_REPLICA_S
    assert v.is_available("v2") and v.prefer_available(["v2", "v1"]) == ["v2", "v1"]


def test_a_lost_mark_ends_when_another_replica_of_the_variant_answers(monkeypatch):
    """A redeploy replaces v1's replica: polls to the old one missed, so v1 was marked lost.
    The same replica answering again keeps the mark (it may be the one dying); the new
    replica answering ends it, not LOST_REPLICA_S later (in the suite, all of a rollout's
    callers went to the canary for the rest of the 30 s)."""
    infos = {"v1": ReplicaInfo((), 8, replica="old"), "v2": ReplicaInfo((), 8, replica="b")}
    v = view(monkeypatch, {"v1": app("RUNNING", 1), "v2": app("RUNNING", 1)}, infos)

    async def main():
        await v.refresh()
        v.replica_lost("v1")
        await v.refresh(max_age_s=0)
        assert not v.is_available("v1")
        infos["v1"] = ReplicaInfo((), 8, replica="new")
        await v.refresh(max_age_s=0)

    asyncio.run(main())
    assert v.is_available("v1") and v.prefer_available(["v1", "v2"]) == ["v1", "v2"]


def test_only_a_gone_replica_counts_as_lost():
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from serve_app.common.failures import replica_gone
    assert replica_gone(ActorUnavailableError("unavailable", None))
    assert replica_gone(ActorDiedError())
    assert not replica_gone(TimeoutError()) and not replica_gone(ValueError("bad request"))


def test_a_running_variant_that_stops_answering_the_poll_is_lost(monkeypatch):
    class Silent:  # what Serve's handle does for a replica on a lost node: never places it
        serving_info = SimpleNamespace(remote=lambda: asyncio.sleep(3600))
    infos = {"v1": ReplicaInfo((), max_num_seqs=8)}
    v = VariantAvailability(
        lambda name: Silent() if name == "v2" else FakeServingInfoHandle(infos[name]),
        period_s=0.01)
    monkeypatch.setattr(serve_view.serve, "status", lambda: SimpleNamespace(
        applications={"v1": app("RUNNING", 1), "v2": app("RUNNING", 1)}))
    for _ in range(availability.MISSED_POLLS_LOST - 1):
        asyncio.run(v.refresh())
        assert v.is_available("v2")  # a miss or two may be a slow moment
    asyncio.run(v.refresh())
    assert not v.is_available("v2") and v.is_available("v1")


def test_a_poll_refused_because_the_queue_is_full_is_not_a_miss(monkeypatch):
    """CI on 2d229cd: a herd filled smollm-v1's handle queue (max_queued_requests 64); three
    polls in a row were refused with BackPressureError and the variant was marked lost for
    30 s while its replica served, so the next test's caller waited for the sleeping
    canary's cold start. A full queue says the replica is busy, not gone."""
    from ray.serve.exceptions import BackPressureError

    class Full:
        async def _remote(self):
            raise BackPressureError(65, 64)
    monkeypatch.setattr(serve_view.serve, "status", lambda: SimpleNamespace(
        applications={"v1": app("RUNNING", 1)}))
    v = VariantAvailability(lambda name: SimpleNamespace(serving_info=SimpleNamespace(
        remote=Full()._remote)))
    for _ in range(availability.MISSED_POLLS_LOST + 1):
        asyncio.run(v.refresh())
    assert v.is_available("v1") and v._missed.get("v1", 0) == 0


def test_a_running_variants_slots_come_from_its_config_until_its_replica_answers(
        monkeypatch):
    """CI on 2d229cd: a herd came in the 0.6 s between smollm-v1's first RUNNING status and
    its replica's first serving_info answer; admission, its capacity unknown, sent all of it
    to Serve's handle, which refused 65 and more (BackPressureError). The deployed
    engine_args' max_num_seqs gives the slots meanwhile."""
    engine_args = {"max_num_seqs": 8}
    monkeypatch.setattr(serve_view, "serve_details", lambda: {"applications": {"v1": {
        "deployed_app_config": {"args": {"engine_args": engine_args}}}}})
    never = asyncio.Event()

    class Slow(FakeServingInfoHandle):
        async def _remote(self):
            await never.wait()
    apps = {"v1": app("RUNNING", 2)}
    monkeypatch.setattr(serve_view.serve, "status", lambda: SimpleNamespace(
        applications=apps))
    v = VariantAvailability(lambda name: Slow(ReplicaInfo((), 8)), period_s=0.01)
    asyncio.run(v.refresh())  # the poll times out: no answer yet
    assert "v1" not in v.info and v.slots("v1") == 16
    engine_args.clear()  # deployed again without it: what the config said no longer holds
    apps["v1"].last_deployed_time_s = 160.0
    asyncio.run(v.refresh())
    assert v.slots("v1") is None


def test_a_deleted_variants_lost_mark_does_not_outlive_it(monkeypatch):
    """A retired variant's polls fail, so it is marked lost for LOST_REPLICA_S; once the
    status no longer lists it, the mark goes: the same name deployed again a moment later is
    available at once (in the suite, canary.yaml redeployed after a retirement)."""
    apps = {"v1": app("RUNNING", 1), "v2": app("RUNNING", 1)}
    v = view(monkeypatch, apps, {"v1": ReplicaInfo((), 8), "v2": ReplicaInfo((), 8)})

    async def main():
        await v.refresh()
        v.replica_lost("v1")  # its replica went with the application
        del apps["v1"]
        await v.refresh()
        apps["v1"] = app("RUNNING", 1)  # deployed again
        await v.refresh()

    asyncio.run(main())
    assert v.is_available("v1") and v.prefer_available(["v2", "v1"]) == ["v2", "v1"]


def test_a_deleted_variants_missed_polls_do_not_count_against_its_next_deploy(monkeypatch):
    """Polls of a variant being deleted time out; once the status no longer lists it, they
    are forgotten, so the variant deployed again under the name is not marked lost by one
    slow first poll of its new replica (in the suite: canary.yaml after a retirement)."""
    apps = {"v1": app("RUNNING", 1)}
    slow = {"v1": False}

    class Handle:
        def __init__(self) -> None:
            self.serving_info = SimpleNamespace(remote=self._remote)

        async def _remote(self):
            if slow["v1"]:
                raise asyncio.TimeoutError  # as a call that did not answer in time
            return ReplicaInfo((), 8)

    monkeypatch.setattr(serve_view.serve, "status", lambda: SimpleNamespace(applications=apps))
    v = VariantAvailability(lambda name: Handle())

    async def main():
        await v.refresh()
        slow["v1"] = True
        for _ in range(availability.MISSED_POLLS_LOST - 1):  # polls during its deletion
            await v.refresh()
        del apps["v1"]
        await v.refresh()
        apps["v1"] = app("RUNNING", 1)  # deployed again: its first poll is slow
        await v.refresh()

    asyncio.run(main())
    assert v.is_available("v1")


@pytest.mark.timeout(20)
def test_a_refresh_that_ended_before_its_caller_resumed_is_not_spun_on(monkeypatch):
    """Issue 28's herd hung the router: a request needing the status arrived between the end
    of the poll's status-less refresh and its caller's resumption, and looped on that ended
    refresh without ever yielding (an ended task is awaited without a pause), so the caller
    that would clear it never ran. Now a refresh that has ended is not waited on."""
    v = view(monkeypatch, {"v1": app("RUNNING", 1)}, {"v1": ReplicaInfo((), 8)})

    async def main():
        await v.refresh()
        ended = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        await ended
        v._refreshing, v._refreshing_status = ended, False  # its caller not resumed yet
        await asyncio.wait_for(v.refresh(), 5)  # needs the status: a new refresh

    asyncio.run(main())
    assert v._refreshing is None


def test_a_variant_deployed_again_under_a_deleted_ones_name_starts_from_nothing(monkeypatch):
    """What a deleted variant's replicas said is forgotten: the application deployed again
    under its name is a first start, so its starting replica does not count as serving (it
    would be polled, miss, and be marked lost before it ran)."""
    apps = {"v1": app("RUNNING", 1)}
    v = view(monkeypatch, apps, {"v1": ReplicaInfo((), 8)})

    async def main():
        await v.refresh()
        del apps["v1"]
        await v.refresh()
        apps["v1"] = SimpleNamespace(status="DEPLOYING", deployments={
            "LLMReplica": SimpleNamespace(replica_states={"STARTING": 1})})
        await v.refresh()

    asyncio.run(main())
    assert v.running("v1") == 0 and "v1" not in v.info


def test_a_deploy_applied_between_two_polls_is_still_read(monkeypatch):
    """A `serve deploy` that gives a variant ``min_replicas: 0`` in place can start and end
    between two status polls: every status reads RUNNING before and after. Its new last
    deploy time makes the view read the deployment details again; else the router would go
    on polling the variant as always on, and each poll would wake it (full20's herd test)."""
    details = {"applications": {}}
    monkeypatch.setattr(serve_view, "serve_details", lambda: details)
    apps = {"v1": SimpleNamespace(status="RUNNING", last_deployed_time_s=100.0,
                                  deployments={})}
    v = view(monkeypatch, apps, {})
    asyncio.run(v.refresh())
    assert v.scales_to_zero == set()
    details = {"applications": {"v1": {"deployments": {"LLMReplica": {"deployment_config": {
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 1}}}}}}}
    asyncio.run(v.refresh())  # the same deploy: the details are not read again
    assert v.scales_to_zero == set()
    apps["v1"].last_deployed_time_s = 160.0  # deployed again; RUNNING all along
    asyncio.run(v.refresh())
    assert v.scales_to_zero == {"v1"}
