"""Weighted, sticky traffic split between the variants of a route.

A caller identity is hashed with the route's salt onto a point u in [0, 1)
(the first 8 bytes of SHA-256, big-endian, divided by 2**64). Variants take consecutive
intervals of [0, 1) in config order, each as wide as its share of the total weight; the
caller gets the variant whose interval holds u. Consequences:

- a caller keeps its variant while the weights stay the same (stickiness);
- when the last variant (the canary) grows at the expense of the one before it, only callers
  move to the canary, never back (monotonic ramp);
- a weight-0 variant has an empty interval and is never chosen.

Requests without an identity draw u uniformly at random.

A *split* is one such weighted choice: a route's variants (key ``route``), or the versions of
an adapter (key ``route:adapter``, arms ``name@vN``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.common.adapters import adapter_key
from serve_app.common.config import RouterConfig
from serve_app.common.policies import RolloutPolicy


@dataclass(frozen=True)
class Split:
    """A weighted split as the router uses it.

    Attributes:
        weighted: ``(arm, weight)`` in config order, stable first.
        salt: hash salt of the sticky assignment.
        rollout: the progressive rollout that owns the weights, if any.
    """

    weighted: list[tuple[str, int]]
    salt: str
    rollout: RolloutPolicy | None = None


def splits_of(config: RouterConfig) -> dict[str, Split]:
    """Every weighted split of a router config, by key: ``route`` (its variants) and
    ``route:adapter`` (the versions of an adapter, arms named ``adapter@vN``)."""
    out = {}
    for route, rc in config.routes.items():
        out[route] = Split([(w.application, w.weight) for w in rc.variants],
                           rc.salt or route, rc.rollout)
        for name, ac in rc.adapters.items():
            key = f"{route}:{name}"
            out[key] = Split([(adapter_key(name, v.version), v.weight) for v in ac.versions],
                             key, ac.rollout)
    return out


def caller_point(salt: str, identity: str) -> float:
    """Map ``identity`` to a stable point in [0, 1) for this ``salt``. Any string hashes,
    a lone surrogate (JSON ``"\\ud800"`` in a client's ``user``) included."""
    digest = hashlib.sha256(f"{salt}\x00{identity}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def pick_by_point(weighted: Sequence[tuple[str, int]], u: float) -> str:
    """Return the name whose cumulative-weight interval holds ``u`` (0 <= u < 1).

    Raises:
        ValueError: every weight is 0.
    """
    total = sum(w for _, w in weighted)
    if total <= 0:
        raise ValueError("no variant has a positive weight")
    threshold = u * total
    cumulative = 0
    for name, weight in weighted:
        cumulative += weight
        if weight > 0 and threshold < cumulative:
            return name
    # u * total can round up to total for u just below 1: take the last positive variant.
    return next(name for name, w in reversed(weighted) if w > 0)


def pick_variant(weighted: Sequence[tuple[str, int]], salt: str, identity: str | None,
                 rng: random.Random | None = None) -> str:
    """Choose a variant: sticky for a known ``identity``, random by weight otherwise."""
    u = caller_point(salt, identity) if identity else (rng or random).random()
    return pick_by_point(weighted, u)


def failover_order(weighted: Sequence[tuple[str, int]], first: str) -> list[str]:
    """Variants to try after ``first`` fails before its first byte: the other positive-weight
    variants by descending weight, then weight-0 variants in config order."""
    positive = sorted((x for x in weighted if x[1] > 0 and x[0] != first), key=lambda x: -x[1])
    zero = [x for x in weighted if x[1] == 0 and x[0] != first]
    return [first] + [name for name, _ in positive + zero]
