"""Admission's refusals (:mod:`serve_app.admission.variant_queue`): each a 503 with a
``Retry-After`` and a message that says what was full and when to retry
(docs/errors.md lists the codes)."""

from __future__ import annotations

import math

#: Bounds of the Retry-After a refusal suggests, s.
MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 10


class Rejected(Exception):
    """A request the variant cannot start in time.

    Attributes:
        reason: ``overloaded`` (at arrival), ``queue_timeout`` (deadline passed while
            queued), ``shed`` (pushed past its deadline by better-priority requests),
            ``cold_start_timeout`` (held past its route's ``cold_start_timeout_s``) or
            ``unavailable`` (no running replica).
        retry_after_s: when a retry may succeed, s (whole seconds).
    """

    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s


def retry_after_s(seconds: float) -> int:
    """A refusal's ``Retry-After`` for a wait of about ``seconds``: whole seconds within
    :data:`MIN_RETRY_AFTER_S` .. :data:`MAX_RETRY_AFTER_S`."""
    return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(seconds))))


def unavailable(variant: str) -> Rejected:
    return Rejected("unavailable", f"variant {variant} has no running replica",
                    MIN_RETRY_AFTER_S)


def overloaded(variant: str, queue_timeout_s: float, running: int, queued: int,
               wait_s: float) -> Rejected:
    """At arrival: the request would wait about ``wait_s`` behind ``queued``."""
    return Rejected("overloaded", f"variant {variant} is at capacity: {running} requests "
                    f"running, {queued} queued; this one would wait about {wait_s:.0f} s "
                    f"(queue_timeout_s {queue_timeout_s:g}); retry later",
                    retry_after_s(wait_s - queue_timeout_s))


def holds_all_it_can(variant: str, queue_timeout_s: float, limit: int,
                     wait_s: float) -> Rejected:
    """At arrival, during a cold start that already holds ``limit`` requests this size."""
    return Rejected("overloaded", f"variant {variant} is starting from zero replicas and "
                    "holds what its first replica can start within queue_timeout_s "
                    f"{queue_timeout_s:g} once warm (about {limit} requests this size), and "
                    "that many wait already; retry once it has started", retry_after_s(wait_s))


def queue_timeout(variant: str, queue_timeout_s: float, service_s: float) -> Rejected:
    return Rejected("queue_timeout", f"variant {variant} could not start the request within "
                    f"queue_timeout_s {queue_timeout_s:g}; retry later",
                    retry_after_s(service_s))


def shed(variant: str, queue_timeout_s: float, service_s: float) -> Rejected:
    return Rejected("shed", f"variant {variant} is at capacity and cannot start this request "
                    f"within queue_timeout_s {queue_timeout_s:g} (requests of its priority or "
                    "better go first); retry later", retry_after_s(service_s))


def cold_start_timeout(variant: str, hold_s: float) -> Rejected:
    return Rejected("cold_start_timeout", f"variant {variant} is starting from zero replicas "
                    f"and did not start within cold_start_timeout_s {hold_s:g}; retry later",
                    MAX_RETRY_AFTER_S)
