"""Token-budget arithmetic of the integration tests: what was charged between two answers, and
what a daily bucket refilled meanwhile."""

from __future__ import annotations


def charged_between(left_before: int, reserved_before: int, cost_before: int,
                    left_after: int, reserved_after: int) -> int:
    """Tokens charged between two answers of a limited tenant, from their
    ``x-ratelimit-remaining-tokens`` (each read after its own reservation): the first
    answer's reservation is settled down to its cost, the second's is still held."""
    return left_before + (reserved_before - cost_before) - left_after - reserved_after


def day_refill(tokens_per_day: int, seconds: float) -> float:
    """Tokens a ``tokens_per_day`` bucket gets back over ``seconds`` (a credit that the
    charge read between two answers does not see)."""
    return seconds * tokens_per_day / 86400
