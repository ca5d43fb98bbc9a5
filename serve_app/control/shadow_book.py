"""``ShadowBook``: aggregates of every route's shadow comparisons, kept by the
``RolloutController`` (so they add up across router replicas) for ``GET /admin/shadows``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from serve_app.observability.stats import percentile

#: Ratios kept per route and shadow for the medians (most recent).
WINDOW = 2000


@dataclass
class _Totals:
    compared: int = 0
    shadow_errors: int = 0
    exact: int = 0
    same_finish: int = 0
    similarity_sum: float = 0.0
    length_ratios: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    ttft_ratios: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    latency_ratios: deque = field(default_factory=lambda: deque(maxlen=WINDOW))


class ShadowBook:
    """Per route and shadow variant: counts, agreement, similarity and ratios."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], _Totals] = {}

    def add(self, c) -> None:
        """One :class:`serve_app.control.shadow_mirror.Comparison`."""
        t = self._totals.setdefault((c.route, c.shadow), _Totals())
        if c.shadow_error is not None:
            t.shadow_errors += 1
            return
        t.compared += 1
        t.exact += c.exact
        t.same_finish += c.same_finish
        t.similarity_sum += c.similarity
        for ratios, value in ((t.length_ratios, c.length_ratio), (t.ttft_ratios, c.ttft_ratio),
                              (t.latency_ratios, c.latency_ratio)):
            if value is not None:
                ratios.append(value)

    def snapshot(self) -> dict[str, Any]:
        """``route -> shadow -> figures``: ``compared`` (pairs both answered),
        ``shadow_errors``, ``agreement`` (exact matches / compared), ``similarity`` (mean,
        0..1), ``finish_agreement``, and the medians of the shadow / primary
        ``length_ratio``, ``ttft_ratio`` and ``latency_ratio``."""
        out: dict[str, Any] = {}
        for (route, shadow), t in sorted(self._totals.items()):
            n = t.compared

            def median(values) -> float | None:
                return round(percentile(list(values), 50), 3) if values else None

            out.setdefault(route, {})[shadow] = {
                "compared": n, "shadow_errors": t.shadow_errors,
                "agreement": round(t.exact / n, 4) if n else None,
                "similarity": round(t.similarity_sum / n, 4) if n else None,
                "finish_agreement": round(t.same_finish / n, 4) if n else None,
                "length_ratio_p50": median(t.length_ratios),
                "ttft_ratio_p50": median(t.ttft_ratios),
                "latency_ratio_p50": median(t.latency_ratios),
            }
        return out
