"""The mesh serves the real embedded model end to end (real Ray, Serve, vLLM, openai client)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_real_answer_and_usage(local_mesh):
    resp = local_mesh.client().chat.completions.create(
        model="smollm", messages=FRANCE, temperature=0, max_tokens=30)
    assert "Paris" in resp.choices[0].message.content
    assert resp.model == "smollm"
    assert resp.usage.prompt_tokens > 0 and resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_matches_non_streaming(local_mesh):
    client = local_mesh.client()
    full = client.chat.completions.create(model="smollm", messages=FRANCE, temperature=0,
                                          max_tokens=30).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm", messages=FRANCE, temperature=0, max_tokens=30, stream=True)
        if c.choices]
    assert sum(1 for p in pieces if p) >= 3
    assert "".join(pieces) == full


def test_stream_is_sse_ending_in_done(local_mesh):
    with local_mesh.http() as http, http.stream("POST", "/v1/chat/completions", json={
            "model": "smollm", "messages": FRANCE, "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-mesh-variant"] == "smollm-v1"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_models_lists_route(local_mesh):
    ids = [m.id for m in local_mesh.client().models.list()]
    assert ids == ["smollm"]


def test_completions_endpoint(local_mesh):
    client = local_mesh.client()
    resp = client.completions.create(model="smollm", prompt="The capital of France is",
                                     temperature=0, max_tokens=5)
    assert "Paris" in resp.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm", prompt="The capital of France is", temperature=0, max_tokens=5,
        stream=True) if c.choices)
    assert streamed == resp.choices[0].text


LONG_PROMPT = "hello " * 3000  # > max_model_len (2048) tokens

BAD_REQUESTS = [
    # (description, body bytes, content type, expected status, expected param or None)
    ("malformed JSON", b'{"model": "smollm", "messages": [', "application/json", 400, None),
    ("missing messages", b'{"model": "smollm"}', "application/json", 400, "messages"),
    ("unknown model", b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}',
     "application/json", 404, "model"),
    ("prompt over max_model_len", json.dumps({"model": "smollm", "messages": [
        {"role": "user", "content": LONG_PROMPT}]}).encode(), "application/json", 400, None),
    ("negative max_tokens", b'{"model": "smollm", "messages": [{"role": "user", "content": "hi"}],'
     b' "max_tokens": -1}', "application/json", 400, "max_tokens"),
    ("max_tokens over the limit", b'{"model": "smollm", "messages": [{"role": "user", '
     b'"content": "hi"}], "max_tokens": 100000}', "application/json", 400, "max_tokens"),
    ("wrong content type", b"model=smollm", "application/x-www-form-urlencoded", 415, None),
    ("body over 4 MiB", b'{"model": "smollm", "messages": [{"role": "user", "content": "'
     + b"a" * (4 * 1024 * 1024) + b'"}]}', "application/json", 413, None),
]


@pytest.mark.parametrize("desc,body,ctype,status,param", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error(local_mesh, desc, body, ctype, status, param):
    with local_mesh.http() as http:
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": ctype})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["message"] and err["type"]
        if param:
            assert err["param"] == param
        # The mesh is still healthy and serving.
        assert http.get("/health").status_code == 200
    ok = local_mesh.client().chat.completions.create(model="smollm", messages=FRANCE,
                                                     temperature=0, max_tokens=10)
    assert "Paris" in ok.choices[0].message.content


def test_openai_client_raises_typed_errors(local_mesh):
    client = local_mesh.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=FRANCE)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm", messages=FRANCE, max_tokens=-5)


def test_client_disconnect_cancels_vllm_request(local_mesh):
    """Closing a stream mid-way aborts the request inside vLLM (no orphaned generation)."""
    from ray import serve

    replica = serve.get_deployment_handle("LLMReplica", app_name="smollm-v1")
    body = {"model": "smollm", "messages": FRANCE, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    during = None
    with httpx.Client(base_url=local_mesh.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += bool(line)
                if chunks == 5:
                    during = replica.stats.remote().result()
                    break
    assert during is not None and during["in_flight"] == 1 and during["engine_unfinished"] == 1
    deadline = time.monotonic() + 20
    while (after := replica.stats.remote().result())["engine_unfinished"] or after["in_flight"]:
        assert time.monotonic() < deadline, f"vLLM kept generating after the client left: {after}"
        time.sleep(0.5)
