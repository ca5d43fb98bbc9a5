"""Unit tests of the router's :class:`Dispatcher` (failover and verdicts) with fake handles
at the edge: no Ray cluster. Admission queues and request accounts are the real ones.

What a candidate's answer or exception causes: a variant failure moves on to the next
candidate (and counts against its arm), a request error or an internal error is this
request's answer, a full variant is a 503 at once, and no candidate left is 503
``no_healthy_variant`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from serve_app.common.errors import MeshError
from serve_app.common.failures import RETRY_AFTER_S, Failure
from serve_app.common.wire import Accepted, Head, Tail, Usage
from serve_app.admission.variant_queue import VariantAdmission
from serve_app.dispatch.dispatcher import Dispatcher
from serve_app.request.planner import VARIANT_HEADER
from serve_app.dispatch.relay import RelayResponse
from tests.support.fakes import (FakeAvailability, FakeHandles, FakeRouterMetrics, FakeStream,
                                 plan_of, registry_of)


def run(answers: dict, *, candidates=("v1", "v2"), capacity: dict | None = None,
        queue_timeout_s: float = 5.0, admissions: dict | None = None, top_priority=True,
        tenant: str = ""):
    """Dispatch one planned request: (the response or the MeshError raised, the facts)."""
    handles, availability, metrics, observed = FakeHandles(answers), FakeAvailability(), FakeRouterMetrics(), []
    if admissions is None:
        admissions = {v: VariantAdmission(v) for v in candidates}
        for v, q in admissions.items():
            q.set_capacity((capacity or {}).get(v, 4))
    dispatcher = Dispatcher(registry_of(handles, availability, admissions))
    plan = plan_of(candidates, queue_timeout_s, top_priority)
    account = metrics.account(lambda arms, **kw: observed.append((arms, kw)), tenant)
    account.labelled(account.tags, plan.arms)  # as the router does

    async def main():
        try:
            return await dispatcher.dispatch(plan, account)
        except MeshError as e:
            return e

    result = asyncio.run(main())
    return result, SimpleNamespace(handles=handles, availability=availability, metrics=metrics,
                                   observed=observed, admissions=admissions, account=account)


OK = Head(200, '{"id":"x"}', usage=Usage(3, 2))


def test_first_candidate_answers_and_every_candidate_gets_the_same_request():
    result, f = run({"v1": FakeStream([Accepted(), OK])})
    assert (result.status_code, result.body) == (200, b'{"id":"x"}')
    assert result.headers[VARIANT_HEADER] == "v1"
    assert f.handles.sent[0][1].request_id == "req-1" and f.handles.sent[0][1].priority == 2
    assert f.metrics.recorded == [("v1", 200, None)]
    assert f.admissions["v1"].in_flight == 0  # the slot went back when it finished


def test_variant_failures_fail_over_and_count_against_the_arm():
    unreachable = ActorUnavailableError("replica unreachable", None)
    full = BackPressureError(num_queued_requests=64, max_queued_requests=64)
    for first in ([unreachable], [full], [Head(503, "{}", failure=Failure.VARIANT)]):
        result, f = run({"v1": FakeStream(first), "v2": FakeStream([Accepted(), OK])})
        assert result.status_code == 200 and result.headers[VARIANT_HEADER] == "v2"
        assert f.metrics.failovers == ["v1"]
        arms, facts = f.observed[0]
        assert arms == (("r", "v1"),) and facts["error"] is True
        assert f.handles.sent[0][1] is f.handles.sent[1][1]  # one request, built once
        assert f.admissions["v1"].in_flight == 0
    # Only an unreachable replica marks its variant as lost (tried last from now on).
    _, f = run({"v1": FakeStream([unreachable]), "v2": FakeStream([Accepted(), OK])})
    assert f.availability.lost == ["v1"]


def test_a_request_error_is_the_answer_and_does_not_fail_over():
    bad = Head(400, json.dumps({"error": {"message": "bad"}}), failure=Failure.REQUEST)
    result, f = run({"v1": FakeStream([Accepted(), bad]), "v2": FakeStream([Accepted(), OK])})
    assert result.status_code == 400 and len(f.handles.sent) == 1
    assert f.metrics.failovers == [] and f.observed == []  # no arm blamed for a 400


def test_an_internal_error_is_one_500_without_failover():
    class ReplicaBug(Exception):
        pass

    from ray.exceptions import RayTaskError

    bug = RayTaskError("generate", "Traceback ...", ReplicaBug("bug")).as_instanceof_cause()
    result, f = run({"v1": FakeStream([bug]), "v2": FakeStream([Accepted(), OK])})
    assert isinstance(result, MeshError) and (result.status, result.code) == (500,
                                                                              "internal_error")
    assert len(f.handles.sent) == 1


def test_no_candidate_left_is_503_with_retry_after():
    gone = FakeStream([Head(503, "{}", failure=Failure.VARIANT)])
    result, f = run({"v1": gone, "v2": FakeStream([Head(503, "{}", failure=Failure.VARIANT)])})
    assert isinstance(result, MeshError)
    assert (result.status, result.code) == (503, "no_healthy_variant")
    assert result.headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert f.metrics.failovers == ["v1", "v2"]


def test_a_replica_that_sends_no_first_item_in_time_is_failed_over_and_cancelled():
    hanging = FakeStream([], hang=True)
    result, f = run({"v1": hanging, "v2": FakeStream([Accepted(), OK])}, queue_timeout_s=0.1)
    assert result.status_code == 200 and hanging.cancelled


def test_a_full_variant_is_503_at_once_and_one_without_replicas_is_skipped():
    # No replica running: the next candidate.
    result, _ = run({"v2": FakeStream([Accepted(), OK])}, capacity={"v1": 0})
    assert result.headers[VARIANT_HEADER] == "v2"
    # Full (queue bound reached): a 503 with the admission's own Retry-After.
    queue = VariantAdmission("v1", max_queued_per_slot=0)
    queue.set_capacity(1)
    queue.in_flight = 1  # its one slot is taken
    refusal, f = run({"v1": FakeStream([Accepted(), OK])}, candidates=("v1",),
                     admissions={"v1": queue}, top_priority=False)
    assert isinstance(refusal, MeshError)
    assert (refusal.status, refusal.code) == (503, "overloaded")
    assert int(refusal.headers["Retry-After"]) >= 1 and f.handles.sent == []


def test_a_request_in_a_newcomer_slot_tells_the_replica_router_so():
    """The replica router places a newcomer slot's request apart (rule 6 of
    replica_affinity): the request it gets says so; any other request does not."""
    def admissions(busy_share_full: bool) -> dict:
        out = {}
        for v in ("v1", "v2"):
            out[v] = VariantAdmission(v, fairness="tokens", newcomer_slots=1)
            out[v].set_capacity(2)
        # the busy tenants' share of v1 (2 - 1 newcomer slot) is full, or not
        out["v1"].in_flight = 1 if busy_share_full else 0
        return out

    _, f = run({"v1": FakeStream([Accepted(), OK])}, admissions=admissions(True),
               tenant="light")
    assert [r.newcomer for _, r in f.handles.sent] == [True]
    _, f = run({"v1": FakeStream([Accepted(), OK])}, admissions=admissions(False),
               tenant="light")
    assert [r.newcomer for _, r in f.handles.sent] == [False]
    # v1's replica fails: v2's slot is an ordinary one, and so is the request it gets
    _, f = run({"v1": FakeStream([ActorUnavailableError("replica unreachable", None)]),
                "v2": FakeStream([Accepted(), OK])}, admissions=admissions(True),
               tenant="light")
    assert [(v, r.newcomer) for v, r in f.handles.sent] == [("v1", True), ("v2", False)]


def test_a_stream_is_relayed():
    stream = FakeStream([Head(200, stream=True), "data: [DONE]\n\n", Tail()])
    result, f = run({"v1": stream})
    assert isinstance(result, RelayResponse) and result.headers[VARIANT_HEADER] == "v1"
    assert not f.account.finished  # the relay finishes it when the stream ends


def test_a_non_stream_abandoned_after_the_replica_took_it_is_charged():
    """A non-stream whose client leaves while the replica runs it (after ``Accepted``, before
    the answer) was taken: its account says so, and its settlement charges the reservation
    (it was free while the head was awaited with the Accepted)."""
    class Runs(FakeStream):
        async def __anext__(self):
            if not self.items:
                await asyncio.sleep(3600)  # the engine runs the request
            return await super().__anext__()

    handles, availability, metrics = FakeHandles({"v1": Runs([Accepted()])}), \
        FakeAvailability(), FakeRouterMetrics()
    admissions = {"v1": VariantAdmission("v1")}
    admissions["v1"].set_capacity(4)
    dispatcher = Dispatcher(registry_of(handles, availability, admissions))
    account = metrics.account(lambda arms, **kw: None)

    async def main():
        task = asyncio.create_task(dispatcher.dispatch(plan_of(("v1",)), account))
        while not handles.sent:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert account.accepted


def test_a_non_stream_failed_over_after_accepted_and_then_abandoned_is_not_taken():
    """The replica took it (Accepted), then answered with a variant failure: it ran nothing
    there. Abandoned while the next candidate is awaited, it is not charged as taken."""
    handles, availability, metrics = FakeHandles({
        "v1": FakeStream([Accepted(), Head(503, "{}", failure=Failure.VARIANT)]),
        "v2": FakeStream([], hang=True)}), FakeAvailability(), FakeRouterMetrics()
    admissions = {v: VariantAdmission(v) for v in ("v1", "v2")}
    for q in admissions.values():
        q.set_capacity(4)
    dispatcher = Dispatcher(registry_of(handles, availability, admissions))
    account = metrics.account(lambda arms, **kw: None)

    async def main():
        task = asyncio.create_task(dispatcher.dispatch(plan_of(("v1", "v2")), account))
        while len(handles.sent) < 2:
            await asyncio.sleep(0.01)
        task.cancel()  # the client left while v2 was awaited
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not account.accepted


def test_a_stream_whose_client_leaves_between_chunks_stops_its_replica_request_at_once():
    """Starlette cancels its send when the client leaves, between two chunks: the relay's
    generators were left to garbage collection, so the replica's request (and vLLM's engine
    request) ran on, and the variant's slot stayed taken. Now both end before the response
    returns."""
    stream = FakeStream([Head(200, stream=True)] + ["data: {}\n\n"] * 50 + [Tail()])
    handles, availability, metrics = FakeHandles({"v1": stream}), FakeAvailability(), \
        FakeRouterMetrics()
    admissions = {"v1": VariantAdmission("v1")}
    admissions["v1"].set_capacity(1)
    dispatcher = Dispatcher(registry_of(handles, availability, admissions))
    account = metrics.account(lambda arms, **kw: None)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "method": "POST", "path": "/v1/chat/completions", "headers": []}
    disconnect = asyncio.Event()

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):  # the client reads two chunks, then leaves
        if message.get("body") and len(stream.items) < 49:
            disconnect.set()
            await asyncio.sleep(3600)

    async def main():
        response = await dispatcher.dispatch(plan_of(("v1",)), account)
        await response(scope, receive, send)
        # in the same loop: asyncio.run's shutdown would close the generators anyway
        return stream.cancelled, admissions["v1"].in_flight

    assert asyncio.run(main()) == (True, 0)
    assert account.finished
