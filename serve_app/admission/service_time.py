"""How long a request holds a variant's slot: what admission's wait estimate is made of
(:mod:`serve_app.admission.variant_queue`).

A request's *size* (:func:`request_size`) is its ``max_tokens`` (its token reservation)
plus :data:`PREFILL_TOKENS`, relative to a request of
:data:`~serve_app.common.wire.CALIBRATION_TOKENS` tokens: a 64-token stream holds its slot
about three times as long as a 16-token one. *Service time* (:class:`ServiceTime`) is how
long a request of size 1 holds a slot *while the variant is full*, s: a moving average over
the requests released while every slot was taken, per unit of the size they generated (an
idle variant's requests finish several times faster than a full one's, so those would make
the queue admit far more than can start in time). Until the variant has been full, it is
what its replicas measured at start-up for a full batch of such requests
(``ReplicaInfo.full_batch_service_s``), so the queue holds about what can start within
``queue_timeout_s`` from the first burst on. That measure runs inside the engine, with no
HTTP path and no client on the host: on a 2-core host the real figure under load is about
twice it, and the first burst is over-admitted until its first requests finish (then the
excess is shed).
"""

from __future__ import annotations

from serve_app.common.wire import CALIBRATION_TOKENS

#: Slot-holding time assumed while a variant has not been full and its replicas measured
#: nothing at start-up, s.
PRIOR_SERVICE_S = 2.0
#: Weight of each new sample in the moving average of service time (the n-th of the first
#: samples weighs 1/n: a running mean, so a variant's first burst soon replaces the start-up
#: measure).
EWMA_ALPHA = 0.2
#: A request's fixed cost (its prefill, its scheduling) in generated-token equivalents, for
#: :func:`request_size`: a rough figure for short prompts on this CPU host.
PREFILL_TOKENS = 8


def request_size(completion_tokens: int) -> float:
    """How long a request holds a slot, relative to one of ``CALIBRATION_TOKENS`` generated
    tokens: ``(completion_tokens + PREFILL_TOKENS) / (CALIBRATION_TOKENS + PREFILL_TOKENS)``.
    Decode dominates a request's time in a full batch, so size follows its tokens."""
    return (max(0, completion_tokens) + PREFILL_TOKENS) / (CALIBRATION_TOKENS + PREFILL_TOKENS)


class ServiceTime:
    """One variant's service time: :attr:`s`, seconds a request of size 1 holds a slot while
    the variant is full."""

    def __init__(self) -> None:
        self.s = PRIOR_SERVICE_S
        self.samples = 0  # releases it was learned from (the variant full)

    def start_up_measure(self, full_batch_service_s: float) -> None:
        """The replicas' start-up measure of a full batch (s; 0: none): the service time
        until the variant has been full."""
        if not self.samples:
            self.s = full_batch_service_s or PRIOR_SERVICE_S

    def learn(self, held_s: float, size: float) -> None:
        """A request of ``size`` held its slot ``held_s`` while the variant was full."""
        self.samples += 1  # the first ones replace the start-up measure quickly
        self.s += max(EWMA_ALPHA, 1 / self.samples) * (held_s / max(1e-3, size) - self.s)

    def tokens_per_s(self) -> float:
        """Completion tokens a second one running request is served while the variant is
        full: a request of size 1 per :attr:`s` (an idle variant serves faster)."""
        return (CALIBRATION_TOKENS + PREFILL_TOKENS) / max(1e-3, self.s)

    def wait_s(self, work: float, slots: int) -> float:
        """Seconds until ``work`` (sizes) has been served on ``slots`` slots."""
        return work * self.s / max(1, slots)

    def work_within(self, seconds: float, slots: int) -> float:
        """Work (sizes) ``slots`` slots serve in ``seconds``."""
        return seconds * slots / max(1e-3, self.s)
