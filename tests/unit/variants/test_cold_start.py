"""Unit tests of scale to zero in the router: the availability view of a variant that scales
to zero, one wake per cold start, requests held until it is warm, a held stream's comment
lines and in-band errors. Serve's status and the replicas are faked (no Ray cluster); the
availability view, admission queues, dispatcher and relay are the real ones. The real
thing runs in tests/integration/test_scale_to_zero.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

import serve_app.variants.availability as availability
import serve_app.variants.serve_view as serve_view
import serve_app.dispatch.dispatcher as dispatcher_module
import serve_app.variants.cold_start as cold_start
from serve_app.common.errors import MeshError
from serve_app.common.wire import Accepted, GenerateRequest, Head, Tail, Usage
from serve_app.admission.variant_queue import VariantAdmission
from serve_app.admission.service_time import request_size
from serve_app.variants.availability import VariantAvailability
from serve_app.dispatch.dispatcher import Dispatcher
from serve_app.request.planner import RequestPlan
from serve_app.dispatch.relay import RelayResponse

from tests.support.fakes import INFO, FakeRouterMetrics, FakeStream, registry_of, status_of


def details_of(zero: set[str]) -> dict:
    """The controller's deployment details: which apps have min_replicas 0 (each declaring
    acme@v1, as INFO serves)."""
    return {"applications": {name: {"deployments": {"LLMReplica": {"deployment_config": {
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 1},
        "user_config": {"adapters": [{"name": "acme", "version": 1}]}}}}} for name in zero}}


class Replicas:
    """Handles of variants whose replica starts when ``start`` is set (the wake call's
    answer waits for it, as Serve's handle queues a call until a replica runs)."""

    def __init__(self, apps: dict[str, dict]):
        self.apps = apps
        self.start = asyncio.Event()
        self.info_calls: list[str] = []
        self.generate_calls: list[str] = []
        self.answers: dict[str, list] = {}

    def __call__(self, application):
        async def serving_info():
            self.info_calls.append(application)
            if self.apps[application].get("RUNNING", 0) == 0:
                await self.start.wait()
                self.apps[application] = {"RUNNING": 1}
            return INFO

        def generate(request):
            self.generate_calls.append(application)
            return FakeStream(self.answers.get(application) or [Accepted(), Head(
                200, '{"id":"x"}', usage=Usage(3, 2))])
        return SimpleNamespace(
            serving_info=SimpleNamespace(remote=serving_info),
            options=lambda stream: SimpleNamespace(generate=SimpleNamespace(remote=generate)))


@pytest.fixture
def mesh(monkeypatch):
    """(availability, replicas, dispatcher, admissions) for v1 (always on, down here) and
    v2 (scales to zero, at zero)."""
    apps, messages = {"v1": {}, "v2": {}}, {}
    monkeypatch.setattr(serve_view.serve, "status", lambda: status_of(apps, messages))
    monkeypatch.setattr(cold_start, "START_ERROR_CHECK_S", 0.02)
    monkeypatch.setattr(serve_view, "serve_details", lambda: details_of({"v2"}))
    monkeypatch.setattr(dispatcher_module, "COMMENT_EVERY_S", 0.05)
    replicas = Replicas(apps)
    admissions = {v: VariantAdmission(v) for v in apps}
    view = VariantAvailability(replicas, on_refresh=lambda: [
        q.set_capacity(view.slots(v)) for v, q in admissions.items()])
    dispatcher = Dispatcher(registry_of(replicas, view, admissions))
    return SimpleNamespace(view=view, replicas=replicas, dispatcher=dispatcher, apps=apps,
                           admissions=admissions, messages=messages)


def plan_of(candidates, *, stream=False, timeout_s=5.0, wake=None) -> RequestPlan:
    body = {"model": "r", "messages": [], "stream": stream}
    return RequestPlan(request=GenerateRequest("chat", body, request_id="req-1"), route="r",
                       adapter="", candidates=tuple(candidates), arms=(("r", ""),),
                       tenant=None, top_priority=True, queue_timeout_s=5.0,
                       cold_start_timeout_s=timeout_s, wake=wake)


async def dispatch(m, plan):
    account = FakeRouterMetrics().account(lambda arms, **kw: None)
    try:
        return await m.dispatcher.dispatch(plan, account), account
    except MeshError as e:
        return e, account


def test_a_variant_that_scales_to_zero_sleeps_is_not_polled_idle_and_keeps_its_adapters(mesh):
    async def main():
        await mesh.view.refresh()
        assert mesh.view.scales_to_zero == {"v2"}
        assert mesh.view.state("v2") == "zero" and mesh.view.is_asleep("v2")
        assert not mesh.view.is_available("v2") and not mesh.view.is_asleep("v1")
        # never seen: what its deployed user_config declares, and nothing else
        assert mesh.view.serves("v2", "acme") and not mesh.view.serves("v2", "globex")
        mesh.apps["v2"] = {"STARTING": 1}
        await mesh.view.refresh()
        assert mesh.view.state("v2") == "starting"
        mesh.apps["v2"] = {"RUNNING": 1}
        await mesh.view.refresh()
        assert mesh.view.state("v2") == "warm" and mesh.replicas.info_calls == []  # idle
        mesh.view.used("v2")
        await mesh.view.refresh()
        assert mesh.replicas.info_calls == ["v2"] and mesh.view.slots("v2") == 8
        mesh.apps["v2"] = {}
        await mesh.view.refresh()
        assert mesh.view.state("v2") == "zero" and mesh.view.adapters["v2"] == {"acme@v1"}
        assert [s["state"] for s in mesh.view.states().values()] == ["zero"]
    asyncio.run(main())


def test_a_variant_that_may_go_to_zero_sooner_than_the_idle_poll_is_polled_less(mesh,
                                                                               monkeypatch):
    """A variant with downscale_delay_s 5 (test_scale_to_zero's) can go to zero 5-8 s after
    the router's last request to it, while the router counted it in use for 10 s: a poll
    then would wake it, and a request sent on the view that still shows it warm would wait
    for its cold start. The router polls such a variant, and trusts its view, for half the
    delay Serve keeps its last replica (``downscale_to_zero_delay_s`` if set, else
    ``downscale_delay_s``, Serve's default 600 s; under the resident budget's policy,
    ``downscale_delay_s``: the policy first waits that long idle)."""
    scaling = {"min_replicas": 0, "max_replicas": 1, "downscale_delay_s": 5.0}
    monkeypatch.setattr(serve_view, "serve_details", lambda: {"applications": {
        "v2": {"deployments": {"LLMReplica": {"deployment_config": {
            "autoscaling_config": scaling}}}}}})
    assert availability.idle_poll_s({"min_replicas": 0}) == availability.IDLE_POLL_S
    to_zero = {**scaling, "downscale_to_zero_delay_s": 1.0}
    assert availability.idle_poll_s(to_zero) == 0.5  # Serve's policy, or any but the budget's
    assert availability.idle_poll_s(to_zero, resident_policy=True) == 2.5

    async def main():
        mesh.apps["v2"] = {"RUNNING": 1}
        await mesh.view.refresh()
        mesh.view.used("v2")
        await mesh.view.refresh()
        assert mesh.replicas.info_calls == ["v2"] and not mesh.view.may_be_asleep("v2")
        mesh.view._used_at["v2"] -= 2.6  # idle past half the delay
        await mesh.view.refresh()
        assert mesh.replicas.info_calls == ["v2"]  # not polled: a poll could wake it
        assert mesh.view.may_be_asleep("v2")  # a request reads the status first
    asyncio.run(main())


def test_requests_during_one_cold_start_make_one_wake_call_and_all_run(mesh):
    async def main():
        await mesh.view.refresh()
        calls = [asyncio.ensure_future(dispatch(mesh, plan_of(["v1", "v2"])))
                 for _ in range(8)]
        await asyncio.sleep(0.1)
        assert mesh.replicas.info_calls == ["v2"] and mesh.view.state("v2") == "starting"
        assert not any(c.done() for c in calls), [c.result() for c in calls if c.done()]  # held, not refused
        mesh.replicas.start.set()
        results = [r for r, _ in await asyncio.gather(*calls)]
        assert [r.status_code for r in results] == [200] * 8
        assert mesh.replicas.info_calls == ["v2"] and mesh.replicas.generate_calls == ["v2"] * 8
        assert mesh.view.state("v2") == "warm" and mesh.admissions["v2"].capacity == 8
    asyncio.run(main())


def test_a_cold_start_past_its_timeout_is_503_and_the_wake_goes_on(mesh):
    async def main():
        await mesh.view.refresh()
        result, _ = await dispatch(mesh, plan_of(["v2"], timeout_s=0.1))
        assert isinstance(result, MeshError) and result.status == 503
        assert result.code == "cold_start_timeout" and "cold_start_timeout_s 0.1" in result.message
        assert int(result.headers["Retry-After"]) > 0
        later = asyncio.ensure_future(dispatch(mesh, plan_of(["v2"])))
        await asyncio.sleep(0.05)
        mesh.replicas.start.set()
        assert (await later)[0].status_code == 200
        assert mesh.replicas.info_calls == ["v2"]  # the later request joined the same wake
    asyncio.run(main())


def test_a_held_stream_sends_comment_lines_then_the_real_first_chunk(mesh):
    mesh.replicas.answers["v2"] = [Head(200, stream=True), 'data: {"choices":[]}\n\n',
                                   "data: [DONE]\n\n", Tail(usage=Usage(3, 1))]

    async def main():
        await mesh.view.refresh()
        response, account = await dispatch(mesh, plan_of(["v1", "v2"], stream=True))
        assert isinstance(response, RelayResponse) and response.status_code == 200
        body = response.body_iterator
        first = await body.__anext__()
        assert first == ": waiting for v2 to start\n\n"
        assert (await body.__anext__()).startswith(": waiting for v2 to start (")
        mesh.replicas.start.set()
        rest = [item async for item in body]
        data = [i for i in rest if not i.startswith(":")]
        assert data == ['data: {"choices":[]}\n\n', "data: [DONE]\n\n"]
        assert account.finished and account.tags["variant"] == "v2"
    asyncio.run(main())


def test_a_held_stream_that_times_out_ends_with_an_in_band_error(mesh):
    async def main():
        await mesh.view.refresh()
        response, account = await dispatch(mesh, plan_of(["v2"], stream=True, timeout_s=0.12))
        items = [item async for item in response.body_iterator]
        assert items[0].startswith(": waiting for v2")
        error = json.loads(items[-1].split("\n\n")[0][len("data: "):])["error"]
        assert error["code"] == "cold_start_timeout" and items[-1].endswith("data: [DONE]\n\n")
        assert account.finished
    asyncio.run(main())


def test_the_splits_sleeping_choice_is_woken_while_a_running_variant_serves(mesh):
    async def main():
        mesh.apps["v1"] = {"RUNNING": 1}
        await mesh.view.refresh()
        result, _ = await dispatch(mesh, plan_of(["v1", "v2"], wake="v2"))
        assert result.status_code == 200 and mesh.replicas.generate_calls == ["v1"]
        await asyncio.sleep(0.01)
        assert mesh.replicas.info_calls.count("v2") == 1 and mesh.view.state("v2") == "starting"
        mesh.replicas.start.set()
        await asyncio.sleep(0.01)
        assert mesh.view.state("v2") == "warm"
    asyncio.run(main())


def test_a_herd_at_a_cold_variant_holds_what_it_can_serve_and_refuses_the_rest_at_once(mesh):
    """Issue 28: 60 requests at a variant at zero. It holds as many as its first replica
    (max_num_seqs 8 when last warm) can start within queue_timeout_s once warm; each of the
    rest gets 503 ``overloaded`` with Retry-After at once; every held one is served."""
    async def main():
        mesh.apps["v2"] = {"RUNNING": 1}
        mesh.view.used("v2")
        await mesh.view.refresh()  # it was warm once: max_num_seqs 8 is known
        mesh.apps["v2"] = {}
        await mesh.view.refresh()
        admission = mesh.admissions["v2"]
        admission.configure(queue_timeout_s=1.0, reserved_slots=0, max_queued_per_slot=None)
        admission.service_time.s = 2.0  # a request of size 1 holds a slot 2 s while full
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        calls = [asyncio.ensure_future(dispatch(mesh, plan_of(["v2"]))) for _ in range(60)]
        await asyncio.sleep(0.05)
        refused = [c.result()[0] for c in calls if c.done()]
        refused_in = loop.time() - t0
        held = [c for c in calls if not c.done()]
        limit = admission.held_limit(request_size(0))
        mesh.replicas.start.set()
        served = [r for r, _ in await asyncio.gather(*held)]
        return refused, refused_in, served, limit

    refused, refused_in, served, limit = asyncio.run(main())
    assert refused and served and len(refused) + len(served) == 60
    assert all(isinstance(r, MeshError) and r.status == 503 and r.code == "overloaded"
               and int(r.headers["Retry-After"]) >= 1 and "starting from zero" in r.message
               for r in refused), refused[:1]
    assert refused_in < 1.0
    assert [r.status_code for r in served] == [200] * len(served)
    # What it held is what a warm replica of 8 slots starts within queue_timeout_s: 8 at
    # once (none kept back here) and 0.9 x 1 s x 8 slots / 2 s = 3.6 more requests of size
    # 1; these (no max_tokens) are of size 8/24: (8 + 3.6) x 3 = 34.8.
    assert len(served) == limit == 34


def test_a_start_that_fails_ends_the_held_requests_with_its_reason_and_backs_off(mesh):
    """Issue 28: the controller reports the woken replica's start error: the held requests
    get 503 ``cold_start_failed`` with the reason at once (not at their timeout); the variant
    leaves the resident view, and requests during the back-off are refused at once with a
    Retry-After; after the back-off a request wakes it again."""
    async def main():
        await mesh.view.refresh()
        loop = asyncio.get_running_loop()
        held = [asyncio.ensure_future(dispatch(mesh, plan_of(["v2"], timeout_s=30)))
                for _ in range(3)]
        await asyncio.sleep(0.05)
        assert not any(c.done() for c in held) and mesh.view.resident("v2")
        t0 = loop.time()
        mesh.messages["v2"] = ("A replica failed to start with exception. Retrying 2 more "
                               "time(s). Error:\nTraceback (most recent call last):\n  ...\n"
                               "RuntimeError: simulated engine start failure (sim.fail_start)")
        ended = [r for r, _ in await asyncio.gather(*held)]
        took = loop.time() - t0
        resident, state = mesh.view.resident("v2"), mesh.view.states()["v2"]["state"]  # /health
        again, _ = await dispatch(mesh, plan_of(["v2"]))
        return ended, took, resident, again, state

    ended, took, resident, again, state = asyncio.run(main())
    assert state == "failed"
    assert took < 1.0
    for r in ended + [again]:
        assert isinstance(r, MeshError) and (r.status, r.code) == (503, "cold_start_failed")
        assert "simulated engine start failure" in r.message, r.message
        assert int(r.headers["Retry-After"]) >= 1
    assert not resident and mesh.replicas.info_calls == ["v2"]  # no second wake


def test_a_start_that_hangs_fails_after_the_routes_cold_start_timeout(mesh):
    """Issue 28: no replica answers within ``give_up_s`` (the router: the largest
    cold_start_timeout_s of its routes): the wake fails, and the variant backs off."""
    mesh.dispatcher.cold_starts.give_up_s = lambda _: 0.1

    async def main():
        await mesh.view.refresh()
        result, _ = await dispatch(mesh, plan_of(["v2"], timeout_s=30))
        return result, mesh.view.failed_start("v2")

    result, why = asyncio.run(main())
    assert isinstance(result, MeshError) and result.code == "cold_start_failed"
    assert "no replica started within 0.1 s" in result.message and why


def test_an_earlier_start_error_still_in_the_status_does_not_fail_the_next_wake(mesh):
    """The controller's message about a start that failed before this wake (it lingers in
    the status) is not this wake's failure: the request is held and served."""
    mesh.messages["v2"] = ("A replica failed to start with exception. Retrying 0 more "
                           "time(s). Error:\nRuntimeError: an earlier failure")

    async def main():
        await mesh.view.refresh()
        call = asyncio.ensure_future(dispatch(mesh, plan_of(["v2"], timeout_s=30)))
        await asyncio.sleep(0.1)  # several looks at the status
        held = not call.done()
        mesh.replicas.start.set()
        return held, (await call)[0]

    held, result = asyncio.run(main())
    assert held and result.status_code == 200
