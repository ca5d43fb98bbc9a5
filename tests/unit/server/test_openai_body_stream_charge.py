"""A stream cut short is charged the tokens it generated, not one per SSE event (no Ray:
the real replica serving logic on a fake engine that streams as vLLM's OpenAI layer does
with ``continuous_usage_stats``, then the real relay and account, whose client leaves).

vLLM merges several tokens into one event when its consumer lags. Before, a cut stream
was charged its prompt bound plus one token per event: 3 events of 50 tokens each were
charged 78 of a 475 reservation (75 + 3). Now the replica asks vLLM for each chunk's usage
and passes the tokens so far along with the text (taking the usage out of what the client
gets unless it asked for it), and the account charges them.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.common.wire import GenerateRequest, Head, Tail, Usage
from serve_app.dispatch.relay import RelayResponse
from serve_app.dispatch.account import RequestAccount
from serve_app.tenancy.limits import TenantLimiter
from serve_app.tenancy.token_budget import Reservation
from tests.support.fake_engine import FakeEngine, replica_server
from tests.support.fakes import NullMetrics
from tests.support.tenants import tenant

PROMPT = 25  # what vLLM counted
BUDGET = 10_000


def chunk(index: int, content: str, completion: int, usage: bool = True) -> str:
    """One event as vLLM's chat stream writes it (pydantic's compact JSON)."""
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "smollm", "choices": [{"index": index, "delta": {"content": content},
                                            "logprobs": None, "finish_reason": None}]}
    if usage:
        body["usage"] = {"prompt_tokens": PROMPT, "total_tokens": PROMPT + completion,
                         "completion_tokens": completion}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


#: A role chunk, then 3 events of 50 tokens each (vLLM merged them), then the final usage
#: chunk and [DONE].
LINES = [chunk(0, "", 0), *(chunk(0, "word " * 50, 50 * k) for k in (1, 2, 3)),
         'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
         '"model":"smollm","choices":[],"usage":{"prompt_tokens":25,"total_tokens":175,'
         '"completion_tokens":150}}\n\n', "data: [DONE]\n\n"]


def replica_items(batching_ms: int = 0, **body) -> list:
    """The replica's answer as the router reads it (:func:`unbundled`: a tail's text first)."""
    from serve_app.common.wire import unbundled

    async def stream():
        for line in LINES:
            yield line

    engine = FakeEngine(stream)
    server = replica_server(engine, {"stream_batching_interval_ms": batching_ms})

    async def main():
        request = GenerateRequest("chat", {"model": "smollm", "messages": [
            {"role": "user", "content": "hi"}], "stream": True, **body})
        return [item async for item in unbundled(server.generate(request))]
    items = asyncio.run(main())
    assert engine.bodies[0][1]["stream_options"].get("continuous_usage_stats") is True
    return items


@pytest.mark.parametrize("batching_ms", [0, 100])
def test_each_piece_carries_the_tokens_so_far_and_the_client_gets_no_usage_it_did_not_ask(
        batching_ms):
    from serve_app.common.wire import StreamText

    items = replica_items(batching_ms)
    assert isinstance(items[0], Head) and items[-1] == Tail(Usage(PROMPT, 150))
    text = items[1:-1]
    assert all(isinstance(t, StreamText) for t in text)
    assert text[-1].usage == Usage(PROMPT, 150)
    import pickle  # as Ray sends it from the replica to the router
    again = pickle.loads(pickle.dumps(text[-1]))
    assert (again, again.usage, type(again)) == (text[-1], text[-1].usage, StreamText)
    assert '"usage"' not in "".join(text)  # neither per chunk nor the final usage chunk
    sent = [json.loads(e[len("data: "):]) for t in text for e in t.split("\n\n")
            if e.startswith("data: {")]
    assert [s["choices"][0]["delta"]["content"] for s in sent] == [
        "", *("word " * 50 for _ in range(3))]  # the text itself is untouched


def test_a_client_that_asked_for_continuous_usage_gets_it_as_vllm_wrote_it():
    items = replica_items(stream_options={"include_usage": True,
                                          "continuous_usage_stats": True})
    assert items[1:-1] == LINES


def test_several_choices_are_summed_per_index():
    from serve_app.server.openai_body import StreamUsage

    progress = StreamUsage({"n": 2}, keep=False)
    for line in (chunk(0, "a", 10), chunk(1, "b", 7), chunk(0, "c", 30)):
        assert '"usage"' not in progress.take(line)
    assert progress.usage == Usage(PROMPT, 37)  # one prompt, choices 30 + 7
    assert progress.take(chunk(0, "x", 0, usage=False)) == chunk(0, "x", 0, usage=False)


async def cut_after_three_events(items: list):
    """The replica's pieces up to its third 50-token event; then the client is gone."""
    events = 0
    for item in items[1:]:
        yield item
        events += item.count('"content":"word')
        if events == 3:
            break
    await asyncio.sleep(3600)


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_cut_stream_is_charged_its_tokens_not_its_events(spec):
    """Reservation 475 (prompt bound 75 + max_tokens 400); the client leaves after 3 events
    of 50 tokens: charged 25 + 150 = 175 (vLLM's prompt count and the tokens generated)."""
    items = replica_items()  # one piece per event

    async def main():
        acme = tenant("acme", tokens_per_day=BUDGET)
        limiter = TenantLimiter(shared=None)
        account = RequestAccount(NullMetrics(), lambda *a, **k: None, {
            "route": "smollm", "variant": "v1", "tenant": "acme", "adapter": ""}, "id-1")
        await account.hold_tenant_slot(limiter, acme, Reservation(75, 400))
        response = RelayResponse(cut_after_three_events(items), "v1", account, {})
        bodies = []

        async def receive():  # ASGI 2.3: Starlette listens, and cancels on a disconnect
            await asyncio.sleep(0.3)
            return {"type": "http.disconnect"}

        async def send(message):  # ASGI 2.4: the next send fails once the client is gone
            if message["type"] == "http.response.body" and message.get("body"):
                bodies.append(message["body"])
                if spec == "2.4" and b"".join(bodies).count(b'"content":"word') == 3:
                    raise OSError("connection reset")  # the third 50-token event was the last

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec},
                 "method": "POST", "path": "/v1/chat/completions", "headers": []}
        try:
            await asyncio.wait_for(response(scope, receive, send), 5)
        except OSError:
            pass
        except Exception as e:  # Starlette's ClientDisconnect
            assert type(e).__name__ == "ClientDisconnect", e
        assert account.finished
        return limiter._local.remaining("acme")["tokens_per_day"]

    assert asyncio.run(main()) == BUDGET - (PROMPT + 150)


def test_the_usage_is_read_from_and_taken_out_of_vllm_s_own_chunks():
    """Chunks serialized by vLLM's own protocol models (chat and completion), with text that
    looks like a usage field: the counts are read, and what the client gets is the same
    chunk without its usage, byte for byte as vLLM would write it without one."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse)
    from vllm.entrypoints.openai.completion.protocol import (CompletionResponseStreamChoice,
                                                             CompletionStreamResponse)
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from serve_app.server.openai_body import StreamUsage

    tricky = 'a,"usage":{"completion_tokens":999}, "index":7'
    chat_chunk = ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[
        ChatCompletionResponseStreamChoice(index=1, delta=DeltaMessage(content=tricky))])
    text_chunk = CompletionStreamResponse(id="d", created=1, model="m", choices=[
        CompletionResponseStreamChoice(index=2, text=tricky, logprobs=None,
                                       finish_reason=None)])
    for response, n, expected in ((chat_chunk, 2, Usage(5, 3)), (text_chunk, 1, Usage(5, 3))):
        bare = f"data: {response.model_dump_json(exclude_unset=True)}\n\n"
        response.usage = UsageInfo(prompt_tokens=5, completion_tokens=3, total_tokens=8)
        line = f"data: {response.model_dump_json(exclude_unset=True)}\n\n"
        progress = StreamUsage({"n": n}, keep=False)
        assert progress.take(line) == bare
        assert progress.usage == expected
