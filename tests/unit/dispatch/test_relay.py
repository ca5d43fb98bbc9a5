"""Unit tests of the SSE relay's accounting (pure ASGI, no Ray): ``finish`` runs exactly once,
however the stream ends, including a client gone before the body starts."""

from __future__ import annotations

import asyncio

from serve_app.dispatch.relay import RelayResponse
from serve_app.common.failures import Failure
from serve_app.common.wire import Tail, Usage
from tests.support.fakes import FakeRouterMetrics

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST",
         "path": "/v1/chat/completions", "headers": []}


async def replica_stream(fail: bool = False):
    yield 'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    if fail:
        raise RuntimeError("engine died")
    yield "data: [DONE]\n\n"
    yield Tail(Usage(prompt_tokens=5, completion_tokens=1))


def run(response: RelayResponse, receive) -> list[dict]:
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(response(SCOPE, receive, send))
    return sent


def finishes():
    """A real RequestAccount over fake metrics: what it records, ``(status, ttft_s, usage,
    error_kind)`` a finish, and the account."""
    metrics = FakeRouterMetrics()
    return metrics.finished, metrics.account(lambda *a, **k: None)


async def never_disconnects():
    await asyncio.sleep(3600)


async def disconnected():
    return {"type": "http.disconnect"}


def test_full_stream_finishes_once_with_usage():
    calls, finish = finishes()
    sent = run(RelayResponse(replica_stream(), "v1", finish, {}),
               never_disconnects)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert body.endswith(b"data: [DONE]\n\n") and b"Usage" not in body
    [(status, ttft, usage, kind)] = calls
    assert (status, kind, usage) == (200, None, Usage(5, 1)) and ttft is not None


def test_failure_mid_stream_ends_with_an_error_event():
    calls, finish = finishes()
    sent = run(RelayResponse(replica_stream(fail=True), "v1", finish, {}),
               never_disconnects)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"variant v1 failed mid-stream; retry the request" in body
    assert body.endswith(b"data: [DONE]\n\n")
    assert [(c[0], c[3]) for c in calls] == [(200, "stream_failed")]


async def in_band_error_stream(failure: Failure):
    """What a replica sends when vLLM ended the stream with an in-band error event."""
    yield 'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
    yield 'data: {"error": {"message": "EngineCore encountered an issue.", "code": 500}}\n\n'
    yield "data: [DONE]\n\n"
    yield Tail(Usage(5, 1), failure=failure, message="EngineCore encountered an issue.")


def test_in_band_error_event_is_a_failed_stream_of_its_kind():
    for failure, kind in ((Failure.VARIANT, "stream_failed"),
                          (Failure.INTERNAL, "internal_error"),
                          (Failure.REQUEST, "request_error")):
        calls, finish = finishes()
        sent = run(RelayResponse(in_band_error_stream(failure), "v1", finish, {}),
                   never_disconnects)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert b'"error"' in body and body.endswith(b"data: [DONE]\n\n")
        assert [(c[0], c[3]) for c in calls] == [(200, kind)]


def test_client_gone_before_the_body_starts_still_finishes_once():
    # ASGI < 2.4: Starlette watches for http.disconnect and cancels the body task, here
    # before the body's generator was ever entered.
    calls, finish = finishes()
    old_spec = {**SCOPE, "asgi": {"version": "3.0", "spec_version": "2.3"}}
    response = RelayResponse(replica_stream(), "v1", finish, {})

    async def stalled_send(message):
        await asyncio.sleep(3600)

    asyncio.run(response(old_spec, disconnected, stalled_send))
    assert calls == [(200, None, Usage(), "client_disconnected")]

    # ASGI >= 2.4: sending the response start fails because the client is gone.
    calls, finish = finishes()
    response = RelayResponse(replica_stream(), "v1", finish, {})

    async def broken_send(message):
        raise OSError("connection reset")

    try:
        asyncio.run(response(SCOPE, never_disconnects, broken_send))
    except Exception as e:
        assert type(e).__name__ == "ClientDisconnect"
    assert calls == [(200, None, Usage(), "client_disconnected")]
