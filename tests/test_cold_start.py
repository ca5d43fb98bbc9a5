"""Unit tests of scale to zero in the router: the availability view of a variant that scales
to zero, one wake per cold start, requests held until it is warm, a held stream's comment
lines and in-band errors. Serve's status and the replicas are faked (no Ray cluster); the
availability view, admission queues, dispatcher and relay are the real ones. The real
thing runs in tests/test_scale_to_zero.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

import serve_app.ingress.availability as availability
import serve_app.ingress.cold_start as cold_start
from serve_app.common.errors import MeshError
from serve_app.common.wire import Accepted, GenerateRequest, Head, ReplicaInfo, Tail, Usage
from serve_app.ingress.admission import VariantAdmission
from serve_app.ingress.availability import VariantAvailability
from serve_app.ingress.cold_start import ColdStarts
from serve_app.ingress.dispatch import Dispatcher
from serve_app.ingress.planner import RequestPlan
from serve_app.ingress.relay import RelayResponse

from test_dispatcher import FakeStream, Metrics

INFO = ReplicaInfo(("acme@v1",), max_num_seqs=8)


def status_of(apps: dict[str, dict]):
    """serve.status() for {app: {"RUNNING": n, "STARTING": m}}."""
    return SimpleNamespace(applications={
        name: SimpleNamespace(status="RUNNING", deployments={
            "LLMReplica": SimpleNamespace(replica_states=states)})
        for name, states in apps.items()})


def details_of(zero: set[str]) -> dict:
    """The controller's deployment details: which apps have min_replicas 0."""
    return {"applications": {name: {"deployments": {"LLMReplica": {"deployment_config": {
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 1}}}}} for name in zero}}


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
    apps = {"v1": {}, "v2": {}}
    monkeypatch.setattr(availability.serve, "status", lambda: status_of(apps))
    monkeypatch.setattr(availability, "serve_details", lambda: details_of({"v2"}))
    monkeypatch.setattr(cold_start, "COMMENT_EVERY_S", 0.05)
    replicas = Replicas(apps)
    admissions = {v: VariantAdmission(v) for v in apps}
    view = VariantAvailability(replicas, on_refresh=lambda: [
        q.set_capacity(view.slots(v)) for v, q in admissions.items()])
    dispatcher = Dispatcher(replicas, admissions.__getitem__, view,
                            ColdStarts(replicas, view))
    return SimpleNamespace(view=view, replicas=replicas, dispatcher=dispatcher, apps=apps,
                           admissions=admissions)


def plan_of(candidates, *, stream=False, timeout_s=5.0, wake=None) -> RequestPlan:
    body = {"model": "r", "messages": [], "stream": stream}
    return RequestPlan(request=GenerateRequest("chat", body, request_id="req-1"), route="r",
                       adapter="", candidates=tuple(candidates), arms=(("r", ""),),
                       tenant=None, top_priority=True, queue_timeout_s=5.0,
                       cold_start_timeout_s=timeout_s, wake=wake)


async def dispatch(m, plan):
    account = Metrics().account(lambda arms, **kw: None)
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
        assert mesh.view.serves("v2", "acme")  # never seen: its replica will say
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


def test_requests_during_one_cold_start_make_one_wake_call_and_all_run(mesh):
    async def main():
        await mesh.view.refresh()
        calls = [asyncio.ensure_future(dispatch(mesh, plan_of(["v1", "v2"])))
                 for _ in range(8)]
        await asyncio.sleep(0.1)
        assert mesh.replicas.info_calls == ["v2"] and mesh.view.state("v2") == "starting"
        assert not any(c.done() for c in calls)  # held, not refused
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
