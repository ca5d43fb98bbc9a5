"""Unit tests of the weighted sticky split (pure logic, no Ray)."""

import math
import random

import pytest

from serve_app.request.split import caller_point, failover_order, pick_by_point, pick_variant


def shares(weighted, n=10_000, salt="smollm"):
    counts = {name: 0 for name, _ in weighted}
    for i in range(n):
        counts[pick_variant(weighted, salt, f"caller-{i}")] += 1
    return counts


@pytest.mark.parametrize("weights", [(90, 10), (50, 50), (1, 99), (70, 20, 10)])
def test_shares_within_3_sigma(weights):
    weighted = [(f"v{i}", w) for i, w in enumerate(weights)]
    n = 10_000
    counts = shares(weighted, n)
    total = sum(weights)
    for name, w in weighted:
        p = w / total
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[name] - n * p) <= 3 * sigma, (name, counts)


def test_same_caller_sticks():
    weighted = [("stable", 50), ("canary", 50)]
    for i in range(200):
        first = pick_variant(weighted, "smollm", f"user-{i}")
        assert all(pick_variant(weighted, "smollm", f"user-{i}") == first for _ in range(5))


def test_ramp_only_moves_callers_to_canary():
    callers = [f"user-{i}" for i in range(5_000)]
    previous = None
    for canary in (0, 5, 25, 50, 100):
        weighted = [("stable", 100 - canary), ("canary", canary)]
        now = {c: pick_variant(weighted, "smollm", c) for c in callers}
        if previous:
            moved_back = [c for c in callers if previous[c] == "canary" and now[c] == "stable"]
            assert moved_back == []
        share = sum(v == "canary" for v in now.values()) / len(callers)
        assert abs(share - canary / 100) < 0.03
        previous = now
    assert set(previous.values()) == {"canary"}


def test_weight_zero_never_chosen():
    weighted = [("a", 0), ("b", 3), ("c", 0)]
    rng = random.Random(1)
    picks = {pick_variant(weighted, "r", None, rng) for _ in range(2_000)}
    picks |= {pick_variant(weighted, "r", f"id{i}") for i in range(2_000)}
    assert picks == {"b"}
    # u just below 1 must not fall off the end onto a weight-0 variant.
    assert pick_by_point(weighted, 0.9999999999999999) == "b"


def test_salt_changes_assignment():
    assert caller_point("route-a", "alice") != caller_point("route-b", "alice")
    assert 0 <= caller_point("x", "y") < 1


def test_random_split_without_identity():
    rng = random.Random(7)
    weighted = [("a", 90), ("b", 10)]
    n = 10_000
    b = sum(pick_variant(weighted, "r", None, rng) == "b" for _ in range(n))
    assert abs(b - 1000) <= 3 * math.sqrt(n * 0.1 * 0.9)


def test_all_zero_raises():
    with pytest.raises(ValueError, match="positive weight"):
        pick_by_point([("a", 0)], 0.5)


def test_failover_order():
    weighted = [("v1", 10), ("v2", 0), ("v3", 80), ("v4", 10)]
    assert failover_order(weighted, "v1") == ["v1", "v3", "v4", "v2"]
    assert failover_order(weighted, "v3") == ["v3", "v1", "v4", "v2"]
