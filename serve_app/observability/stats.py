"""Summary statistics shared by the rollout gates, the load generator and the drills."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (``statistics.quantiles``, inclusive
    method); NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if 0 < q < 100 \
        else (min(values) if q <= 0 else max(values))
