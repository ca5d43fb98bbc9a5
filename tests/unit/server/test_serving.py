"""Unit tests of the replica's serving logic (:class:`ReplicaServer`) with a fake engine at
the edge: no Ray, no vLLM engine. The adapter set is the real one, over the real registry
(its SHA-256 and base-model checks run), with a fake for vLLM's LoRA loader.

The integration suites (``test_serving.py``, ``test_traffic_safety.py``, ...) run the same code
on real engines; these pin down each verdict and body rewrite on its own.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

from serve_app.common.failures import Failure
from serve_app.common.wire import (ADAPTER_HEADER, REPLICA_HEADER, Accepted, GenerateRequest,
                                   Head, Tail, Usage)
from serve_app.server.lora import AdapterSet
from serve_app.server.serving import EngineAnswer, EngineError, ReplicaServer
from tests.support.bodies import chat_body
from tests.support.fake_engine import FakeEngine, FakeLoRAModels, noop, replica_server

SERVED_BY = {REPLICA_HEADER: "r1"}  # every head names the replica


def collect(s: ReplicaServer, request: GenerateRequest) -> list:
    async def main():
        return [item async for item in s.generate(request)]
    return asyncio.run(main())


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def chat(**fields) -> GenerateRequest:
    """A chat request with ``fields``, as the router sends it (priority 3, id ``req-9``)."""
    return GenerateRequest("chat", chat_body(**fields), priority=3, request_id="req-9")


def test_whole_answer_body_rewrites_and_usage():
    engine = FakeEngine(EngineAnswer('{"id":"x"}', Usage(5, 2)))
    s = replica_server(engine, {"system_prompt": "Be brief.", "stream_batching_interval_ms": 0})
    items = collect(s, chat())
    assert items == [Accepted(), Head(200, '{"id":"x"}', headers=SERVED_BY, usage=Usage(5, 2))]
    endpoint, body = engine.bodies[0]
    assert endpoint == "chat"
    assert body["priority"] == 3 and body["request_id"] == "req-9"
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    # A caller's own system message wins; a completion gets no system prompt.
    collect(s, chat(messages=[{"role": "system", "content": "Mine."}]))
    assert [m["content"] for m in engine.bodies[1][1]["messages"]] == ["Mine."]
    collect(s, GenerateRequest("completion", {"model": "smollm", "prompt": "hi"}))
    assert "messages" not in engine.bodies[2][1]
    assert s.in_flight == 0


def test_priority_reaches_the_engine_only_with_priority_scheduling():
    engine = FakeEngine(EngineAnswer("{}"), priority_scheduling=False)
    collect(replica_server(engine), chat())
    assert "priority" not in engine.bodies[0][1]


@pytest.mark.parametrize("asked", [False, True])
def test_stream_usage_goes_to_the_tail_and_to_the_client_only_if_asked(asked):
    lines = [sse({"choices": [{"delta": {"content": "Hi"}}]}),
             sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}),
             "data: [DONE]\n\n"]

    async def stream():
        for line in lines:
            yield line

    engine = FakeEngine(stream)
    options = {"stream_options": {"include_usage": True}} if asked else {}
    items = collect(replica_server(engine), chat(stream=True, **options))
    assert engine.bodies[0][1]["stream_options"] == {  # always asked, at the end and in each
        "include_usage": True, "continuous_usage_stats": True}
    assert items[0] == Head(200, stream=True, headers=SERVED_BY)
    assert items[1:-1] == (lines if asked else [lines[0], lines[2]])
    assert items[-1] == Tail(Usage(7, 1))


def test_adapter_request_runs_on_its_version_and_shows_the_name_the_client_asked():
    engine = FakeEngine(lambda: EngineAnswer('{"model":"acme-support@v2","id":"x"}'))
    s = replica_server(engine, {"adapters": [{"name": "acme-support", "version": 2},
                                     {"name": "acme-support", "version": 1}],
                        "stream_batching_interval_ms": 0})
    assert s.serving_info().adapters == ("acme-support@v1", "acme-support@v2")
    head = collect(s, chat(model="smollm:acme-support"))[1]
    assert engine.bodies[0][1]["model"] == "acme-support@v2"  # the first listed is default
    assert head.body == '{"model":"smollm:acme-support","id":"x"}'
    assert head.headers[ADAPTER_HEADER] == "acme-support@v2"
    # The version an adapter split chose.
    collect(s, GenerateRequest("chat", {"model": "smollm:acme-support", "messages": []},
                               adapter_version="acme-support@v1"))
    assert engine.bodies[1][1]["model"] == "acme-support@v1"
    assert s.adapters.status()["active"]["acme-support@v1"]["in_flight"] == 0


def test_adapter_in_flight_is_held_until_the_stream_ends():
    async def stream():
        yield sse({"choices": [{"delta": {"content": "Hi"}}]})
        yield "data: [DONE]\n\n"

    s = replica_server(FakeEngine(stream), {"adapters": [{"name": "acme-support", "version": 1}],
                                    "stream_batching_interval_ms": 0})

    async def main():
        gen = s.generate(chat(model="smollm:acme-support", stream=True))
        assert (await gen.__anext__()).status == 200
        held = s.adapters.status()["active"]["acme-support@v1"]["in_flight"]
        await gen.aclose()  # the router cancelled (client left)
        return held

    assert asyncio.run(main()) == 1
    assert s.adapters.status()["active"]["acme-support@v1"]["in_flight"] == 0
    assert s.in_flight == 0


def test_an_adapter_this_variant_does_not_serve_is_the_requests_404():
    items = collect(replica_server(FakeEngine(EngineAnswer("{}"))), chat(model="smollm:nobody"))
    head = items[1]
    assert (head.status, head.failure) == (404, Failure.REQUEST)
    assert json.loads(head.body)["error"]["code"] == "adapter_not_found"


class Body(BaseModel):
    max_tokens: int


def test_verdicts_of_what_the_engine_raises_or_answers():
    try:
        Body.model_validate({"max_tokens": "many"})
    except Exception as e:  # a pydantic ValidationError, as vLLM's protocol raises
        invalid = e
    cases = [
        (FakeEngine(raises=invalid), 400, Failure.REQUEST),
        (FakeEngine(EngineError(400, "bad temperature", "temperature")), 400, Failure.REQUEST),
        (FakeEngine(raises=RuntimeError("bug")), 500, Failure.INTERNAL),
        (FakeEngine(raises=RecursionError()), 400, Failure.REQUEST),
    ]
    for engine, status, failure in cases:
        head = collect(replica_server(engine), chat())[1]
        assert (head.status, head.failure) == (status, failure), head
    head = collect(replica_server(cases[1][0]), chat())[1]
    assert json.loads(head.body)["error"]["param"] == "temperature"
    dead = FakeEngine(EngineError(500, "EngineCore died"))
    dead.errored = True
    head = collect(replica_server(dead), chat())[1]
    assert (head.status, head.failure) == (503, Failure.VARIANT)
    assert json.loads(head.body)["error"]["code"] == "engine_dead"


def test_in_band_errors_and_a_broken_stream_end_in_a_failed_tail():
    async def in_band():
        yield sse({"choices": [{"delta": {"content": "Hi"}}]})
        yield sse({"error": {"code": 500, "message": "engine died"}})
        yield "data: [DONE]\n\n"

    engine = FakeEngine(in_band)
    engine.errored = True  # the engine died under the stream
    tail = collect(replica_server(engine), chat(stream=True))[-1]
    assert tail.failure is Failure.VARIANT

    async def broken():
        yield sse({"choices": [{"delta": {"content": "Hi"}}]})
        raise RuntimeError("generator broke")

    items = collect(replica_server(FakeEngine(broken)), chat(stream=True))
    assert items[-2].startswith('data: {"error"') and items[-2].endswith("data: [DONE]\n\n")
    assert items[-1].failure is Failure.INTERNAL


def test_injected_fault_is_a_variant_failure():
    s = replica_server(FakeEngine(EngineAnswer("{}")),
               {"fault_injection": {"error_rate": 1.0}, "stream_batching_interval_ms": 0})
    head = collect(s, chat())[1]
    assert (head.status, head.failure) == (503, Failure.VARIANT)
    assert json.loads(head.body)["error"]["code"] == "injected_fault"


def test_reconfigure_keeps_the_last_good_config_and_refuses_a_bad_first_one():
    s = replica_server(FakeEngine(EngineAnswer("{}")), {"system_prompt": "A."})
    asyncio.run(s.reconfigure({"system_prompt": 5}))
    assert s.config.system_prompt == "A."
    asyncio.run(s.reconfigure({"adapters": [{"name": "no-such-adapter", "version": 1}]}))
    assert s.adapters.refused  # refused on its own; the config still applies
    fresh = ReplicaServer("smollm-v1", FakeEngine(), s.adapters)
    with pytest.raises(ValueError, match="user_config"):
        asyncio.run(fresh.reconfigure({"system_prompt": 5}))


def test_a_merged_variant_serves_its_adapter_from_the_model_weights_with_no_lora():
    engine = FakeEngine(lambda: EngineAnswer('{"model":"smollm","id":"x"}'))
    adapters = AdapterSet(FakeLoRAModels(), SimpleNamespace(remove_lora=noop),
                          base_model="smollm2-135m-acme", max_lora_rank=16)
    s = ReplicaServer("smollm-acme", engine, adapters, replica="r1", merged="acme-support@v1")
    asyncio.run(s.reconfigure({"stream_batching_interval_ms": 0}))
    assert s.serving_info().adapters == ("acme-support@v1",)
    assert s.serving_info().merged == "acme-support@v1"
    head = collect(s, chat(model="smollm:acme-support"))[1]
    assert engine.bodies[0][1]["model"] == "smollm"  # the route: the base weights, no LoRA
    assert head.body == '{"model":"smollm:acme-support","id":"x"}'
    assert head.headers[ADAPTER_HEADER] == "acme-support@v1"
    assert adapters.models.loads == []
    # another version of the name is not what the model holds: not served here
    other = collect(s, GenerateRequest("chat", {"model": "smollm:acme-support", "messages": []},
                                       adapter_version="acme-support@v2"))[1]
    assert (other.status, other.failure) == (404, Failure.VARIANT)  # the router fails over


def test_a_promoted_versions_old_one_serves_requests_naming_it_for_the_grace(monkeypatch):
    """Issue 28: acme-support v1/v2 promoted to v2 only. The router may still send
    ``acme-support@v1`` on a view a moment old: it is served for RETIRED_GRACE_S, not a 404;
    an unversioned request gets v2 at once; after the grace v1 is a 404. A name removed
    altogether (nothing replaced it) is a 404 at once."""
    import time

    import serve_app.server.lora_reconcile as lora_reconcile  # (where the grace is read)

    monkeypatch.setattr(lora_reconcile, "RETIRED_GRACE_S", 0.3)
    engine = FakeEngine(lambda: EngineAnswer('{"id":"x"}'))
    v1, v2 = {"name": "acme-support", "version": 1}, {"name": "acme-support", "version": 2}
    globex = {"name": "globex-report", "version": 1}
    s = replica_server(engine, {"adapters": [v1, v2, globex], "stream_batching_interval_ms": 0})
    asyncio.run(s.reconfigure({"adapters": [v2], "stream_batching_interval_ms": 0}))

    def ask(version: str | None = None, model: str = "smollm:acme-support") -> Head:
        return collect(s, GenerateRequest("chat", {"model": model, "messages": []},
                                          adapter_version=version))[1]

    # the router's view lists it meanwhile, so the router may pick this replica for it
    assert s.serving_info().adapters == ("acme-support@v1", "acme-support@v2")
    assert ask("acme-support@v1").status == 200
    assert engine.bodies[-1][1]["model"] == "acme-support@v1"
    assert ask().status == 200 and engine.bodies[-1][1]["model"] == "acme-support@v2"
    assert ask(model="smollm:globex-report").status == 404  # removed, not replaced
    time.sleep(0.35)
    assert ask("acme-support@v1").status == 404
    assert s.serving_info().adapters == ("acme-support@v2",)


def test_an_adapter_stream_names_the_model_the_client_asked_in_every_chunk():
    """The last text travels with the Tail (one message fewer): it too names
    ``route:adapter``, never the engine's ``name@vN``."""
    chunks = [sse({"model": "acme-support@v1", "choices": [{"delta": {"content": c}}]})
              for c in ("a", "b", "c")]

    async def lines():
        for c in chunks:
            yield c

    engine = FakeEngine(lambda: lines())
    s = replica_server(engine, {"adapters": [{"name": "acme-support", "version": 1}],
                                "stream_batching_interval_ms": 50})
    items = collect(s, chat(model="smollm:acme-support", stream=True))
    text = "".join(str(i) for i in items if isinstance(i, str)) + "".join(
        i.text for i in items if isinstance(i, Tail))
    assert text.count('"model":"smollm:acme-support"') == 3, items
    assert "acme-support@v1" not in text


def test_a_chats_role_chunk_travels_with_its_first_token():
    """vLLM yields a chat's role-only chunk just before its first token's: the replica sends
    both in one message (one Ray message fewer per stream), and nothing else is joined."""
    role = sse({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                              "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
    tokens = [sse({"choices": [{"index": 0, "delta": {"content": word}}]})
              for word in ("Hi", " there")]

    async def stream():
        for line in [role, *tokens, "data: [DONE]\n\n"]:
            yield line

    s = replica_server(FakeEngine(stream), {"stream_batching_interval_ms": 0})
    items = collect(s, chat(stream=True))
    assert items[1:-1] == [role + tokens[0], tokens[1], "data: [DONE]\n\n"]


def test_a_stream_that_ends_before_its_first_token_still_sends_its_role_chunk():
    role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None}]})

    async def stream():
        yield role
        raise RuntimeError("engine died")

    items = collect(replica_server(FakeEngine(stream), {"stream_batching_interval_ms": 0}),
                    chat(stream=True))
    assert items[1].startswith(role) and '"error"' in items[1]
    assert items[-1].failure is Failure.INTERNAL
