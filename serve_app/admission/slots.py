"""What admission (:mod:`serve_app.admission.variant_queue`) gives a request: a :class:`Slot`
now, or a place in the queue (:class:`Waiter`); else a refusal
(:mod:`serve_app.admission.refusals`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ask:
    """What one request asks of a variant's admission (:meth:`VariantAdmission.take`).

    Attributes:
        priority: the tenant's priority (lower is served first).
        top: it has the best priority configured (it may use reserved slots).
        tenant: the tenant id ("" in open mode).
        prompt_tokens: its reservation's bound on its prompt, tokens.
        completion_tokens: its reservation's bound on what it generates (``max_tokens``, or
            the rest of the context), tokens.
        stream: a streamed request (its completion counts as it is relayed).
    """

    priority: int = 0
    top: bool = True
    tenant: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stream: bool = False


@dataclass(frozen=True)
class Counted:
    """How a request's service counts for its tenant while it runs
    (:mod:`serve_app.admission.fair_share`), weighted tokens: ``prompt`` when it starts (its
    prefill is its first engine step; at the prompt's bound until vLLM's usage gives the
    count) and, for a non-stream, its completion by the time it has run, up to
    ``non_stream_up_to`` (its ``max_tokens``; 0: a stream, counted as its tokens are
    relayed)."""

    prompt: float = 0.0
    non_stream_up_to: float = 0.0


@dataclass
class Waiter:
    """A queued request (:meth:`VariantAdmission.enter`); :meth:`VariantAdmission.wait`
    waits for its slot."""

    priority: int
    seq: int
    deadline: float
    top: bool
    future: asyncio.Future
    tenant: str = ""
    size: float = 1.0  # request_size of its reservation
    counts: Counted = field(default_factory=Counted)
    held: bool = False  # waits for a cold start (no slot may be granted before it is warm)
    hold_s: float = 0.0  # the longest it may wait for that, s
    left: bool = False  # no longer queued (FairQueue.leave)


@dataclass
class Slot:
    """A granted slot; give it back with :meth:`VariantAdmission.release`."""

    granted_at: float
    tenant: str = ""
    counts: Counted = field(default_factory=Counted)
    counted: float = 0.0  # its service counted so far (its prompt, a stream's tokens relayed)
    size: float = 1.0  # request_size of its reservation
    released: bool = False
    priority: int = 0
    top: bool = True
    newcomer: bool = False  # in a newcomer slot (FairShare.newcomer)
