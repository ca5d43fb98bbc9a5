"""Streaming chat load generator (official ``openai`` async client), shared by the benchmark
and the zero-drop tests.

Each request streams a chat completion with ``max_tokens`` and ``ignore_eos`` (a vLLM
extension), so a complete answer has exactly ``max_tokens`` completion tokens; the result
records whether the stream ended with ``[DONE]`` (the SDK raises otherwise), the status, the
variant that served it (``x-mesh-variant``), TTFT and latency.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from serve_app.observability.stats import percentile


@dataclass
class RequestResult:
    """One streamed request. Times in seconds from its start."""

    ok: bool
    status: int
    completion_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    variant: str | None = None
    text: str = ""
    error: str | None = None
    started_at: float = 0.0  # time.monotonic() at start


@dataclass
class LoadSpec:
    """What to send: ``requests`` streamed chats, ``concurrency`` at a time."""

    base_url: str
    model: str
    requests: int = 32
    concurrency: int = 4
    max_tokens: int = 64
    prompt: str = "Tell me a story about a robot."
    api_key: str = "none"
    headers: dict[str, str] = field(default_factory=dict)
    duration_s: float | None = None  # if set: keep going until this many seconds passed
    # If set, request i sends the OpenAI `user` field f"{user_prefix}{i}": each request is a
    # new caller for the sticky split (without it, callers of one tenant share a variant).
    user_prefix: str | None = None
    # If set, request i sends `x-request-id: {request_id_prefix}-{i}` (the id in the router's
    # access log).
    request_id_prefix: str | None = None
    timeout_s: float = 180  # per request
    # If set: request i asks for mix[i % len(mix)] = (model, api_key) instead of model and
    # api_key: a multi-tenant mix (e.g. two tenants' adapters and the base model).
    mix: tuple[tuple[str, str], ...] = ()


async def stream_one(client: openai.AsyncOpenAI, spec: LoadSpec, user: str | None = None,
                     model: str | None = None, request_id: str | None = None
                     ) -> RequestResult:
    """Send one streaming chat request (``model``, default ``spec.model``; ``request_id``:
    its ``x-request-id``) and account for it; never raises."""
    t0 = time.monotonic()
    res = RequestResult(ok=False, status=0, started_at=t0)
    pieces: list[str] = []
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model or spec.model, messages=[{"role": "user", "content": spec.prompt}],
            max_tokens=spec.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={**spec.headers, **({"x-request-id": request_id} if request_id
                                              else {})},
            **({"user": user} if user else {}))
        res.status, res.variant = raw.status_code, raw.headers.get("x-mesh-variant")
        stream = raw.parse()
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t0
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage:
                res.completion_tokens = chunk.usage.completion_tokens
                res.prompt_tokens = chunk.usage.prompt_tokens
        res.ok = res.status == 200 and res.completion_tokens == spec.max_tokens
        if not res.ok:
            res.error = f"incomplete: {res.completion_tokens}/{spec.max_tokens} tokens"
    except openai.APIStatusError as e:
        res.status, res.error = e.status_code, str(e)[:300]
    except Exception as e:  # connection reset, truncated stream, timeout
        res.error = f"{type(e).__name__}: {e}"[:300]
    res.latency_s = time.monotonic() - t0
    res.text = "".join(pieces)
    return res


async def run_load(spec: LoadSpec, stop: threading.Event | None = None,
                   results: list[RequestResult] | None = None) -> list[RequestResult]:
    """Run the load; returns one result per request, in completion order.

    Stops starting new requests after ``spec.requests`` (or ``spec.duration_s``), or once
    ``stop`` is set; requests in flight always finish. ``results``, if given, is filled in
    place (so another thread can watch progress)."""
    mix = spec.mix or ((spec.model, spec.api_key),)
    clients = {key: openai.AsyncOpenAI(base_url=spec.base_url, api_key=key, max_retries=0,
                                       timeout=spec.timeout_s) for _, key in mix}
    results = [] if results is None else results
    deadline = time.monotonic() + spec.duration_s if spec.duration_s else None
    counter = iter(range(10**9))

    async def worker() -> None:
        while True:
            i = next(counter)
            if deadline is None and i >= spec.requests:
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            if stop is not None and stop.is_set():
                return
            user = f"{spec.user_prefix}{i}" if spec.user_prefix is not None else None
            model, key = mix[i % len(mix)]
            request_id = (f"{spec.request_id_prefix}-{i}" if spec.request_id_prefix is not None
                          else None)
            results.append(await stream_one(clients[key], spec, user=user, model=model,
                                            request_id=request_id))

    try:
        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    finally:
        for client in clients.values():
            await client.close()
    return results


@contextmanager
def background_load(spec: LoadSpec) -> Iterator[list[RequestResult]]:
    """Run :func:`run_load` in a thread while the ``with`` body runs (e.g. deploys); on exit,
    stop starting requests and wait for those in flight. Yields the results list, filled as
    requests finish."""
    results: list[RequestResult] = []
    stop = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(run_load(spec, stop, results)))
    thread.start()
    try:
        yield results
    finally:
        stop.set()
        thread.join(timeout=spec.timeout_s + 60)


def wait_for_results(results: list[RequestResult], n: int, *, started_after: float | None = None,
                     timeout_s: float = 600) -> None:
    """Block until ``n`` requests of a :func:`background_load` have finished (only those
    started after ``started_after``, a ``time.monotonic()`` value, when given).

    Tests drive a load to a count this way, not for a time: a slow shared host then makes
    the test slower, not wrong.

    Raises:
        TimeoutError: fewer than ``n`` finished within ``timeout_s`` s (a stalled mesh).
    """
    deadline = time.monotonic() + timeout_s

    def done() -> int:
        return sum(started_after is None or r.started_at > started_after for r in list(results))

    while done() < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {done()} of {n} requests finished in {timeout_s:.0f} s")
        time.sleep(0.2)


@dataclass
class Answer:
    """One request of a flood: its status and, when refused, how fast and with what advice.

    Attributes:
        status: HTTP status; 0 when the client gave up (timeout) or the connection failed.
        latency_s: from sending until the status arrived (a refusal) or the answer ended, s.
        retry_after: the ``Retry-After`` header of a refusal, if any.
        timed_out: the client's own timeout fired first.
        code: a refusal's OpenAI error ``code`` (e.g. ``overloaded``, ``shed``), if any; for
            a stream, the code of an in-band error event that ended it.
        stream: it was a streamed request.
        status_s: from sending until the status line arrived, s.
        complete: a 200 whose stream ended with ``data: [DONE]`` and no error event (a
            whole answer: True).
        held: a stream whose body began with an SSE comment line (``: waiting for ...``,
            a cold start held it) and whose first data line is a completion chunk.
    """

    status: int
    latency_s: float
    retry_after: str | None = None
    timed_out: bool = False
    code: str | None = None
    stream: bool = False
    status_s: float = 0.0
    complete: bool = False
    held: bool = False


def _error_code(r: httpx.Response) -> str | None:
    """The OpenAI error ``code`` of a refusal's body; None for an answer or another body."""
    if r.status_code == 200:
        return None
    try:
        return (r.json().get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


async def flood(base_url: str, api_key: str, *, requests: int, max_tokens: int = 16,
                timeout_s: float = 60, model: str = "smollm", streams: int = 0,
                headers: dict[str, str] | None = None,
                request_id_prefix: str | None = None) -> list[Answer]:
    """Send ``requests`` chat requests all at once (no retries), the first ``streams`` of
    them streamed, and record how each ended. Uses plain ``httpx`` with the bodies prepared
    up front, so the client's own cost stays small next to the mesh's (a flood must measure
    the mesh, not the client). ``headers``: extra request headers (e.g. a variant pin);
    ``request_id_prefix``: request ``i`` sends ``x-request-id: <prefix>-<i>`` (the id in the
    router's access log)."""
    bodies = [json.dumps({"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                          "stream": i < streams, "user": f"flood-{i}",
                          "messages": [{"role": "user", "content":
                                        f"Write a line about the number {i}."}]}).encode()
              for i in range(requests)]
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json",
               **(headers or {})}
    limits = httpx.Limits(max_connections=requests + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:

        async def one(i: int, body: bytes) -> Answer:
            t0 = time.monotonic()
            headers_i = ({**headers, "x-request-id": f"{request_id_prefix}-{i}"}
                         if request_id_prefix else headers)
            try:
                if i >= streams:
                    r = await http.post("/chat/completions", content=body, headers=headers_i)
                    return Answer(r.status_code, time.monotonic() - t0,
                                  r.headers.get("retry-after"), code=_error_code(r),
                                  status_s=time.monotonic() - t0, complete=r.status_code == 200)
                async with http.stream("POST", "/chat/completions", content=body,
                                       headers=headers_i) as r:
                    status_s = time.monotonic() - t0
                    if r.status_code != 200:
                        await r.aread()
                        return Answer(r.status_code, status_s, r.headers.get("retry-after"),
                                      code=_error_code(r), stream=True, status_s=status_s)
                    lines = [line async for line in r.aiter_lines() if line]
                data = [line[6:] for line in lines if line.startswith("data: ")]
                errors = [json.loads(d)["error"] for d in data if d.startswith('{"error"')]
                held = (lines[0].startswith(":") and bool(data) and not errors
                        and '"chat.completion.chunk"' in data[0])
                return Answer(200, time.monotonic() - t0, stream=True, status_s=status_s,
                              code=errors[0].get("code") if errors else None,
                              complete=data[-1:] == ["[DONE]"] and not errors, held=held)
            except httpx.TimeoutException:
                return Answer(0, time.monotonic() - t0, timed_out=True, stream=i < streams)
            except httpx.HTTPError:
                return Answer(0, time.monotonic() - t0, stream=i < streams)

        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


async def probe(spec: LoadSpec, stop: asyncio.Event, pause_s: float = 0.2
                ) -> list[RequestResult]:
    """Send ``spec``'s streamed chats one after another until ``stop`` is set (or
    ``spec.requests`` were sent); the results carry each request's TTFT."""
    client = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0,
                                timeout=spec.timeout_s)
    results: list[RequestResult] = []
    try:
        while not stop.is_set() and len(results) < spec.requests:
            results.append(await stream_one(client, spec))
            await asyncio.sleep(pause_s)
    finally:
        await client.close()
    return results


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Throughput and latency figures: tokens/s over the wall time, TTFT and latency p50/p95
    in ms over successful requests, error count."""
    good = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1000 for r in good if r.ttft_s is not None]
    lat = [r.latency_s * 1000 for r in good]
    return {
        "requests": len(results),
        "errors": len(results) - len(good),
        "tokens_per_s": sum(r.completion_tokens for r in good) / wall_s if wall_s else 0.0,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p95_ms": percentile(ttft, 95),
        "latency_p50_ms": percentile(lat, 50), "latency_p95_ms": percentile(lat, 95),
    }
