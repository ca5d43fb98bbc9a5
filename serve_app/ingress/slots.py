"""What admission (:mod:`serve_app.ingress.admission`) gives a request: a :class:`Slot`
now, or a place in the queue (:class:`Waiter`); else a refusal
(:mod:`serve_app.ingress.refusals`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


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
    non_stream_tokens: int = 0  # a non-stream's max_tokens (0: a stream), see Slot
    held: bool = False  # waits for a cold start (no slot may be granted before it is warm)
    hold_s: float = 0.0  # the longest it may wait for that, s


@dataclass
class Slot:
    """A granted slot; give it back with :meth:`VariantAdmission.release`."""

    granted_at: float
    tenant: str = ""
    counted: float = 0.0  # its service counted while it ran (a stream's tokens relayed)
    unrelayed_up_to: float = 0.0  # a non-stream: its service while it runs is estimated,
    # up to this (its max_tokens, weighted); 0: a stream, counted as its tokens are relayed
    size: float = 1.0  # request_size of its reservation
    released: bool = False
    priority: int = 0
    top: bool = True
    newcomer: bool = False  # in a newcomer slot: its tenant had nothing in flight
