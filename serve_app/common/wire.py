"""The router <-> replica protocol: what the router sends an ``LLMReplica`` through a Serve
``DeploymentHandle`` (one :class:`GenerateRequest`) and what the replica streams back.

Every call of ``LLMReplica.generate(request)`` is a streaming call whose first item is
:class:`Accepted` for a non-stream (and for a stream that waits for its adapter), then a
:class:`Head`; then, only when ``Head.stream`` is true, SSE text (``"data: {...}\\n\\n"``)
ending with ``"data: [DONE]\\n\\n"``, each piece a :class:`StreamText` that carries the
stream's token counts so far, then one :class:`Tail` (not sent to the client).
The router decides the HTTP status from the head before
sending any byte, which is what makes failover before the first byte possible.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from serve_app.common.failures import Failure

#: Response header naming the adapter version that served (``name@vN``).
ADAPTER_HEADER = "x-mesh-adapter"
#: Response header naming the replica that served (Serve's replica id, 8 characters).
REPLICA_HEADER = "x-mesh-replica"


def sse_error(body: dict[str, Any]) -> str:
    """An in-band SSE error event (an OpenAI error ``body``) and the stream's end, the way
    vLLM ends a stream that failed after its status was sent."""
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


#: Generated tokens per request of a replica's start-up calibration batch
#: (``ReplicaInfo.full_batch_service_s``): the size of a short chat answer.
CALIBRATION_TOKENS = 16


@dataclass(frozen=True)
class GenerateRequest:
    """One OpenAI request as the router sends it to a variant's replica (built once per
    request by the planner; the shadow mirror derives its own with ``dataclasses.replace``).

    Attributes:
        endpoint: ``"chat"`` (``/v1/chat/completions``) or ``"completion"``
            (``/v1/completions``).
        body: the OpenAI request body; ``body["model"]`` is ``route`` or ``route:adapter``.
        adapter_version: the version (``name@vN``) an adapter split chose; None: the
            adapter's default version serves.
        priority: the tenant's priority (vLLM convention: lower is served first); it reaches
            vLLM when the engine runs ``scheduling_policy: priority``.
        request_id: the router's ``x-request-id``; it becomes vLLM's request id
            (``chatcmpl-<id>``).
        session: the caller's conversation, a fixed-size digest of its tenant and its
            ``x-session-id`` or ``user``; None when the caller gave neither. The replica
            router keeps a session on one replica (:mod:`serve_app.replica_routing.affinity`).
        queue_timeout_s: the route's ``queue_timeout_s``, s: the longest the replica lets it
            wait for an adapter slot (then 503 ``adapter_capacity``).
        newcomer: admission started it in a newcomer slot (``Slot.newcomer``); the replica
            router then looks for an engine seat free of recent prefills for a base-model
            request (rule 6 of :mod:`serve_app.replica_routing.affinity`).
    """

    endpoint: Literal["chat", "completion"]
    body: dict[str, Any]
    adapter_version: str | None = None
    priority: int = 0
    request_id: str | None = None
    session: str | None = None
    queue_timeout_s: float = 30.0
    newcomer: bool = False


@dataclass(frozen=True)
class Usage:
    """Token counts of one request (OpenAI ``usage``), for the router's metrics."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class StreamText(str):
    """A piece of a stream's SSE text as the client gets it, with ``usage``: the stream's
    token counts up to its end (vLLM's ``continuous_usage_stats``), so a router whose client
    leaves mid-stream charges the tokens generated, not one per SSE event (vLLM merges
    several tokens into one event when its consumer lags). A ``str``: the relay sends it
    as it is."""

    usage: Usage

    def __new__(cls, text: str, usage: Usage) -> StreamText:
        piece = super().__new__(cls, text)
        piece.usage = usage
        return piece

    def __reduce__(self):
        return StreamText, (str(self), self.usage)


@dataclass(frozen=True)
class Head:
    """Status of a replica's answer.

    Attributes:
        status: HTTP status to return (200 or an OpenAI error status).
        body: the JSON response body for non-streaming answers and errors; ``None`` when
            ``stream`` is true.
        stream: SSE lines follow this head.
        headers: extra HTTP headers (e.g. ``Retry-After``).
        usage: token counts of a non-streaming answer.
        failure: for an error, its kind (:mod:`serve_app.common.failures`); the router fails over
            only on ``Failure.VARIANT``.
    """

    status: int
    body: str | None = None
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    usage: Usage | None = None
    failure: Failure | None = None


@dataclass(frozen=True)
class Accepted:
    """The first item of a non-streaming answer, and of a stream that must wait for an
    adapter slot: the replica has the request. The router time-boxes the wait for this item
    (a replica it cannot reach, e.g. on a lost node, must not hold the request), then waits
    for the :class:`Head` as long as generation (or the replica's bounded adapter wait)
    takes."""


async def read_head(stream, timeout_s: float,
                    on_accepted: Callable[[], None] = lambda: None) -> Head:
    """The :class:`Head` of a replica's answer ``stream`` (a Serve streaming response).

    The first item must come within ``timeout_s`` (a replica that cannot be reached must not
    hold the request); after an :class:`Accepted` the head may take as long as the replica
    needs. ``on_accepted`` is called as the ``Accepted`` arrives, before that wait: a
    non-stream abandoned during it was taken by the replica (and is charged).

    Raises:
        asyncio.TimeoutError: no first item within ``timeout_s``.
        Exception: whatever the call raised (a dead replica, ...).
    """
    first = await asyncio.wait_for(stream.__anext__(), timeout_s)
    if isinstance(first, Accepted):
        on_accepted()
        return await stream.__anext__()
    return first


@dataclass(frozen=True)
class Tail:
    """The end of a stream: its token counts and, when vLLM ended it with an in-band error
    event, the kind of that failure.

    Attributes:
        usage: token counts of the stream.
        failure: None for a stream that completed.
        message: the in-band error's message, for logs.
    """

    usage: Usage = field(default_factory=Usage)
    failure: Failure | None = None
    message: str = ""
    #: The stream's last text, when it was ready with the end: sent in the same message
    #: (one Ray message fewer per stream); :func:`unbundled` gives it back as text.
    text: str = ""


async def unbundled(stream) -> AsyncIterator[Any]:
    """The items of a replica's stream after its head, with a :class:`Tail` that carries the
    stream's last text given as that text, then the tail without it."""
    async for item in stream:
        if isinstance(item, Tail) and item.text:
            yield item.text
            item = replace(item, text="")
        yield item


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica tells the router's availability poll (``LLMReplica.serving_info``).

    Attributes:
        adapters: adapter versions (``name@vN``) that take new requests.
        max_num_seqs: requests its engine runs at once (vLLM ``max_num_seqs``): the
            replica's share of the variant's admission slots.
        priority_scheduling: the engine schedules by request ``priority``
            (``scheduling_policy: priority``).
        defaults: the version (``name@vN``) of each adapter name that a request naming no
            version gets.
        merged: the adapter version merged into the variant's model weights
            (``scripts/prepare_model.py --merge-adapter``), which it serves with no LoRA;
            "" for none.
        full_batch_service_s: seconds a request of :data:`CALIBRATION_TOKENS` generated tokens
            held the engine in a full batch at start-up
            (:meth:`~serve_app.server.engine_protocol.Engine.full_batch_service_s`); 0.0 when not
            measured.
        max_model_len: the engine's context length, tokens (0: unknown): what a chat with no
            ``max_tokens`` may generate at most (vLLM's default, the rest of the context).
        replica: the Serve replica id that answered ("" when unknown).
    """

    adapters: tuple[str, ...] = ()
    max_num_seqs: int = 0
    priority_scheduling: bool = False
    defaults: tuple[str, ...] = ()
    merged: str = ""
    full_batch_service_s: float = 0.0
    max_model_len: int = 0
    replica: str = ""
