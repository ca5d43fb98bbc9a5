"""A catalog of malformed and edge-case OpenAI requests: bad types, empty and huge values,
deep nesting, odd unicode, token-id prompts, structured-output schemas, sampling extremes.

Each case is sent to the mesh by ``tests/integration/test_traffic_safety.py``: none may get a status
>= 500, fail over, or count against a rollout's arm; every error must be an OpenAI error
body. ``expect`` is what the answer must be: ``"4xx"`` (a client error) or ``"any"`` (either a
200 or a client error: what vLLM's own server does for it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Say hi."}]
VALID_SCHEMA = {"type": "json_schema", "json_schema": {
    "name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "string"}},
                                 "required": ["a"]}}}


@dataclass(frozen=True)
class Case:
    """One request: ``body`` (a dict sent as JSON, or raw bytes) to ``path``."""

    name: str
    path: str
    body: dict[str, Any] | bytes
    expect: str = "4xx"  # "4xx" or "any"
    headers: dict[str, str] = field(default_factory=dict)

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def chat(name: str, expect: str = "4xx", **fields) -> Case:
    return Case(name, CHAT, {"model": "smollm", "messages": HI, "max_tokens": 4, **fields},
                expect)


def completion(name: str, expect: str = "4xx", **fields) -> Case:
    return Case(name, COMPLETIONS, {"model": "smollm", "prompt": "Hello", "max_tokens": 4,
                                    **fields}, expect)


def nested(depth: int) -> bytes:
    return b'{"model": "smollm", "messages": ' + b"[" * depth + b"]" * depth + b"}"


CASES: list[Case] = [
    # -- chat: messages ------------------------------------------------------------------------
    chat("messages is a string", messages="hello"),
    # 400 on vLLM; 200 on a variant whose user_config adds a default system prompt.
    chat("messages is empty", expect="any", messages=[]),
    chat("message without role", messages=[{"content": "hi"}]),
    chat("unknown role", expect="any", messages=[{"role": "wizard", "content": "hi"}]),
    chat("content is a number", messages=[{"role": "user", "content": 42}]),
    chat("content part of unknown type", messages=[{"role": "user", "content": [
        {"type": "hologram", "hologram": "x"}]}]),
    chat("image part on a text-only model", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
    chat("content over max_model_len",
         messages=[{"role": "user", "content": "hello " * 3000}]),
    Case("messages nested 50,000 deep", CHAT, nested(50_000)),
    Case("messages nested 900 deep", CHAT, nested(900)),
    # -- chat: sampling extremes ---------------------------------------------------------------
    chat("max_tokens is a string", max_tokens="ten"),
    chat("max_tokens is 0", max_tokens=0),
    chat("max_tokens is 10**12", max_tokens=10**12),
    chat("temperature is negative", temperature=-1),
    chat("temperature is 1e9", expect="any", temperature=1e9),
    chat("top_p over 1", top_p=2),
    chat("top_k below -1", top_k=-5),
    chat("n is 0", n=0),
    chat("n is a string", n="many"),
    chat("top_logprobs over the limit", logprobs=True, top_logprobs=100),
    chat("stop is a number", stop=7),
    chat("presence_penalty out of range", presence_penalty=10),
    chat("frequency_penalty out of range", frequency_penalty=-10),
    chat("logit_bias with a token id past the vocabulary", logit_bias={"999999999": 100}),
    chat("min_tokens over max_tokens", min_tokens=10),
    chat("seed is a string", seed="lucky"),
    chat("stream is a string", stream="yes please"),
    chat("stream_options without stream", stream_options={"include_usage": True}),
    chat("stream_options is a list", stream=True, stream_options=[1, 2]),
    chat("priority set by the client", priority=-100),
    chat("unknown extra field", expect="any", frobnicate=True),
    chat("ignore_eos with max_tokens 1", expect="any", ignore_eos=True, max_tokens=1),
    # -- chat: structured output ---------------------------------------------------------------
    chat("response_format of unknown type", response_format={"type": "yaml"}),
    chat("json_schema without a schema", response_format={"type": "json_schema"}),
    chat("valid json_schema", expect="any", response_format=VALID_SCHEMA, max_tokens=12),
    chat("tuple-form items right after a valid json_schema", expect="any", max_tokens=12,
         response_format={"type": "json_schema", "json_schema": {
             "name": "t", "schema": {"type": "array", "items": [{"type": "string"}]}}}),
    chat("tuple-form items, streamed", expect="any", max_tokens=12, stream=True,
         response_format={"type": "json_schema", "json_schema": {
             "name": "t", "schema": {"type": "array", "items": [{"type": "string"}]}}}),
    chat("json_schema with an unknown type", expect="any", response_format={
        "type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nope"}}}),
    chat("structured_outputs regex that does not compile", structured_outputs={"regex": "(["}),
    chat("structured_outputs with an empty choice list", structured_outputs={"choice": []}),
    chat("structured_outputs grammar that does not parse",
         structured_outputs={"grammar": "root ::= ((("}),
    chat("tool without a function name", tools=[{"type": "function", "function": {}}]),
    chat("tool_choice names a tool that does not exist", tools=[{"type": "function",
         "function": {"name": "f", "parameters": {"type": "object"}}}],
         tool_choice={"type": "function", "function": {"name": "g"}}),
    # -- chat: odd unicode ---------------------------------------------------------------------
    Case("lone surrogate in content", CHAT,
         b'{"model": "smollm", "max_tokens": 4, "messages": [{"role": "user", "content": '
         b'"bad \\ud800 surrogate"}]}', expect="any"),
    chat("zero-width, right-to-left and emoji", expect="any", messages=[
        {"role": "user", "content": "\u200b\u202eolleh\u202c \U0001F600 \u0645\u0631\u062d\u0628\u0627"}]),
    chat("NUL characters in content", expect="any",
         messages=[{"role": "user", "content": "a\u0000b\u0000c"}]),
    Case("body is not UTF-8", CHAT, b'{"model": "smollm", "messages": "\xff\xfe"}'),
    # -- model field ---------------------------------------------------------------------------
    chat("model is a number", model=7),
    chat("model names an adapter nobody serves", model="smollm:nope"),
    chat("model names an adapter version", model="smollm:acme-support@v1"),
    # -- completions: prompts ------------------------------------------------------------------
    completion("empty prompt", prompt=""),
    completion("empty prompt list", prompt=[]),
    completion("prompt of token ids", expect="any", prompt=[1, 2, 3, 4]),
    completion("token id past the vocabulary", prompt=[99_999_999]),
    completion("negative token id", prompt=[-1]),
    completion("token ids nested three deep", prompt=[[[1]]]),
    completion("prompt is an object", prompt={"text": "hi"}),
    completion("prompt_embeds that are not embeddings", prompt_embeds="not base64 tensors"),
    completion("logprobs over the limit", logprobs=1000),
    completion("echo", expect="any", echo=True),
    completion("best_of below n", expect="any", n=2, best_of=1),
    completion("stop list of 100 strings", expect="any", stop=[f"s{i}" for i in range(100)]),
    # -- bodies --------------------------------------------------------------------------------
    Case("body is a JSON array", CHAT, b"[1, 2, 3]"),
    Case("body is empty", CHAT, b""),
]
