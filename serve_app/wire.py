"""What an ``LLMReplica`` streams back to the router through a Serve ``DeploymentHandle``.

Every call of ``LLMReplica.generate`` is a streaming call whose first item is a
:class:`Head`; then, only when ``Head.stream`` is true, SSE lines (``"data: {...}\\n\\n"``)
ending with ``"data: [DONE]\\n\\n"``, then one :class:`Usage` (not sent to the client).
The router decides the HTTP status from the head before
sending any byte, which is what makes failover before the first byte possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SSE_DONE = "data: [DONE]\n\n"
#: Response header naming the adapter version that served (``name@vN``).
ADAPTER_HEADER = "x-mesh-adapter"


@dataclass(frozen=True)
class Usage:
    """Token counts of one request (OpenAI ``usage``), for the router's metrics."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


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
    """

    status: int
    body: str | None = None
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    usage: Usage | None = None
