"""The OpenAI request body as vLLM gets it, and vLLM's answer as the client gets it.

The replica changes a client's body in one place, :func:`engine_body`, and vLLM's SSE lines
and JSON in one place, :func:`for_client`. Pure functions of dicts and strings: unit-tested
without an engine (``tests/unit/server/test_serving.py``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from enum import IntFlag
from typing import Any

from serve_app.common.wire import ADAPTER_HEADER, GenerateRequest, Head, StreamText, Tail, Usage

#: How vLLM's stream generators start an in-band error event (then ``data: [DONE]``).
IN_BAND_ERROR = 'data: {"error"'


class UsageWanted(IntFlag):
    """Which usage a streaming client asked for: ``FINAL`` the usage chunk at the end
    (``stream_options.include_usage``), ``CONTINUOUS`` usage in every chunk as well
    (``continuous_usage_stats``, with ``include_usage``). True when it asked for any."""

    NONE = 0
    FINAL = 1
    CONTINUOUS = 2


def engine_body(request: GenerateRequest, *, model: str | None, priority_scheduling: bool,
                system_prompt: str | None) -> tuple[dict[str, Any], UsageWanted]:
    """The body vLLM's OpenAI serving layer is given for ``request``.

    - ``model``: when given, the name vLLM serves it under: the resident LoRA's name
      (``name@vN``) for an adapter request, the route for one served from merged weights;
    - ``priority``: the tenant's, when the engine runs ``scheduling_policy: priority``;
    - ``request_id``: the router's ``x-request-id``;
    - chat only: the variant's ``system_prompt`` first, unless the client sent a system or
      developer message;
    - streams always ask for usage, at the end (``stream_options.include_usage``, for the
      router's token metrics) and in every chunk (``continuous_usage_stats``: the tokens
      generated so far, which the replica takes out of each chunk, :class:`StreamUsage`),
      so a stream its client leaves is charged its tokens.

    Returns:
        ``(body, client_wants_usage)``: the usage the client itself asked for
        (:class:`UsageWanted`; only that is passed on).
    """
    body = dict(request.body)
    if model is not None:
        body["model"] = model
    if priority_scheduling:
        body["priority"] = request.priority
    if request.request_id:
        body["request_id"] = request.request_id
    messages = body.get("messages")
    if (request.endpoint == "chat" and system_prompt and isinstance(messages, list)
            and not any(isinstance(m, dict) and m.get("role") in ("system", "developer")
                        for m in messages)):
        body["messages"] = [{"role": "system", "content": system_prompt}, *messages]
    options = body.get("stream_options")
    client_wants_usage = UsageWanted.NONE
    if isinstance(options, dict) and options.get("include_usage"):
        client_wants_usage = UsageWanted.FINAL | (
            UsageWanted.CONTINUOUS if options.get("continuous_usage_stats") else 0)
    if body.get("stream") and (options is None or isinstance(options, dict)):
        body["stream_options"] = {**(options or {}), "include_usage": True,
                                  "continuous_usage_stats": True}
    return body, client_wants_usage


class StreamUsage:
    """A stream's token counts so far, from the usage vLLM puts in each chunk
    (``continuous_usage_stats``): per choice ``index``, its completion tokens so far, and
    its prompt's tokens (a completion's prompt ``i`` has choices ``i * n`` to
    ``i * n + n - 1``, as vLLM numbers them).

    Args:
        body: the engine body (``n``).
        keep: the client asked for usage in every chunk; else :meth:`take` takes it out.
    """

    def __init__(self, body: dict[str, Any], keep: bool) -> None:
        n = body.get("n")
        self.n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        self.keep = keep
        self._completion: dict[int, int] = {}  # choice index -> completion tokens so far
        self._prompt: dict[int, int] = {}  # prompt index -> its tokens

    @property
    def usage(self) -> Usage:
        return Usage(sum(self._prompt.values()), sum(self._completion.values()))

    def take(self, line: str) -> str:
        """Record the usage of ``line`` (one SSE event) and return the line as the client
        gets it: without that usage unless :attr:`keep`. Anything it cannot read is
        passed on as it is."""
        at = line.find(',"usage":{') if line.startswith("data: {") else -1
        index_at = line.find('"index":')
        if at < 0 or index_at < 0:
            return line
        try:
            usage, end = json.JSONDecoder().raw_decode(line, at + len(',"usage":'))
            index, _ = json.JSONDecoder().raw_decode(line, index_at + len('"index":'))
            self._completion[int(index)] = int(usage.get("completion_tokens") or 0)
            self._prompt[int(index) // self.n] = int(usage.get("prompt_tokens") or 0)
        except (ValueError, TypeError, AttributeError):
            return line
        return line if self.keep else line[:at] + line[end:]

    def text(self, line: str) -> StreamText:
        """``line`` with the stream's usage so far, for the router."""
        return StreamText(line, self.usage)


def for_client(item: Head | str | Tail, engine_model: str, requested: str,
               version: str) -> Head | str | Tail:
    """vLLM names the model it ran (the LoRA ``name@vN``, or the route for merged weights) as
    ``model`` in its JSON: show what the client asked (``route:adapter``) instead, and say
    which adapter version served in the ``x-mesh-adapter`` header."""
    old, new = f'"model":"{engine_model}"', f'"model":"{requested}"'
    if isinstance(item, StreamText):
        return StreamText(item.replace(old, new), item.usage)
    if isinstance(item, str):
        return item.replace(old, new)
    if isinstance(item, Head):
        return replace(item, body=item.body.replace(old, new) if item.body else item.body,
                       headers={**item.headers, ADAPTER_HEADER: version})
    if isinstance(item, Tail) and item.text:  # the stream's last text, sent with its end
        return replace(item, text=for_client(item.text, engine_model, requested, version))
    return item


def wants_structured_output(body: dict[str, Any]) -> bool:
    """Whether the request asks for structured output (OpenAI ``response_format`` other
    than text, vLLM's ``structured_outputs`` or its older ``guided_*`` fields)."""
    fmt = body.get("response_format")
    return (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or bool(
        body.get("structured_outputs")) or any(
        body.get(k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"))


def usage_chunk(line: str) -> dict[str, Any] | None:
    """The ``usage`` of vLLM's final usage chunk (empty ``choices``), else None; only that
    line is parsed."""
    if line.startswith("data: {") and '"choices":[]' in line and '"usage":{' in line:
        return json.loads(line[len("data: "):])["usage"]
    return None


def in_band_error(line: str) -> dict[str, Any] | None:
    """The ``error`` of an in-band SSE error event (``data: {"error": {...}}``), else None."""
    if line.startswith(IN_BAND_ERROR):
        return json.loads(line[len("data: "):])["error"]
    return None
