"""Unit tests of the progressive rollout state machine (pure logic, a fake clock).

The real-stack evidence is tests/integration/test_rollouts.py; these pin the verdict rules
exactly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.common.config import RouterConfig
from serve_app.common.policies import RolloutGates, RolloutPolicy
from serve_app.request.split import splits_of
from serve_app.control.rollout import Observation, Rollout, failed_gates, figures

POLICY = RolloutPolicy(steps=[10, 50, 100], min_requests=5, min_step_s=30,
                       gates=RolloutGates(max_error_rate_increase=0.1, max_latency_p95_ratio=1.5,
                                          max_ttft_p95_ratio=None))


def feed(r: Rollout, arm: str, n: int, *, error=False, latency_s=1.0, truncated=False):
    for _ in range(n):
        r.observe(Observation("smollm", arm, error or truncated, truncated, 0.1, latency_s))


def test_healthy_canary_advances_after_min_requests_and_time_then_promotes():
    r = Rollout("smollm", "v1", "v2", POLICY, now=0)
    assert r.weights() == {"v1": 90, "v2": 10}
    feed(r, "v1", 20)
    feed(r, "v2", 4)
    assert r.evaluate(100) is None  # 4 < min_requests
    feed(r, "v2", 1)
    assert r.evaluate(10) is None  # 10 s < min_step_s
    d = r.evaluate(30)
    assert d["decision"] == "advance" and d["canary_weight"] == 50 and d["step"] == 1
    assert d["canary"]["requests"] == 5 and d["stable"]["requests"] == 20
    assert r.weights() == {"v1": 50, "v2": 50}
    assert r.evaluate(1000) is None  # the new step starts with no canary requests
    feed(r, "v2", 5)
    assert r.evaluate(60)["canary_weight"] == 100
    feed(r, "v2", 5)
    d = r.evaluate(90)
    assert d["decision"] == "promote" and r.state == "promoted"
    assert r.weights() == {"v1": 0, "v2": 100}
    assert [h["decision"] for h in r.history] == ["start", "advance", "advance", "promote"]
    assert r.evaluate(500) is None


def test_errors_roll_back_within_the_step_without_waiting_for_min_step_s():
    r = Rollout("smollm", "v1", "v2", POLICY, now=0)
    feed(r, "v1", 10)
    feed(r, "v2", 3)
    feed(r, "v2", 2, error=True)  # 40 % errors vs 0 %
    d = r.evaluate(1)
    assert d["decision"] == "rollback" and r.state == "rolled_back"
    assert d["reason"] == "error rate 40.0% vs stable 0.0% (+40.0% > +10.0%)"
    assert d["canary"]["errors"] == 2 and d["canary_weight"] == 0
    assert r.weights() == {"v1": 100, "v2": 0}


def test_latency_ratio_gate_needs_a_baseline():
    r = Rollout("smollm", "v1", "v2", POLICY, now=0)
    feed(r, "v2", 5, latency_s=4.0)
    feed(r, "v1", 4, latency_s=1.0)  # 4 < MIN_BASELINE: the ratio is not judged
    assert r.evaluate(1) is None and r.state == "progressing"
    feed(r, "v1", 1, latency_s=1.0)
    d = r.evaluate(2)
    assert d["decision"] == "rollback"
    assert d["reason"] == "latency p95 4000 ms vs stable 1000 ms (x4.00 > x1.5)"


def test_truncated_streams_gate():
    stable = figures([Observation("s", "v1", False, False, 0.1, 1.0)] * 10)
    canary = figures([Observation("s", "v2", True, True, 0.1, 1.0)]
                     + [Observation("s", "v2", False, False, 0.1, 1.0)] * 19)
    gates = RolloutGates(max_error_rate_increase=0.5)
    assert failed_gates(gates, canary, stable) == ["1 truncated streams > 0"]


def test_pause_resume_abort_come_from_the_deployed_policy():
    r = Rollout("smollm", "v1", "v2", POLICY, now=0)
    r.apply_policy(POLICY.model_copy(update={"paused": True}), now=5)
    feed(r, "v2", 10)
    assert r.state == "paused" and r.evaluate(100) is None and r.weights()["v2"] == 10
    r.apply_policy(POLICY, now=50)
    assert r.state == "progressing" and r.step_started_at == 50
    feed(r, "v2", 5)
    assert r.evaluate(60) is None  # the step's clock restarted on resume
    r.apply_policy(POLICY.model_copy(update={"abort": True}), now=70)
    assert r.state == "aborted" and r.weights() == {"v1": 100, "v2": 0}
    assert [h["decision"] for h in r.history] == ["start", "pause", "resume", "abort"]


def test_rollout_config_rules():
    with pytest.raises(ValidationError, match=r"steps \[50, 20\] must be strictly increasing"):
        RolloutPolicy(steps=[50, 20])
    with pytest.raises(ValidationError, match="a rollout needs exactly two variants"):
        RouterConfig.model_validate({"routes": {"r": {
            "variants": [{"application": a, "weight": 1} for a in ("a", "b", "c")],
            "rollout": {}}}})
    cfg = RouterConfig.model_validate({"routes": {"r": {
        "variants": [{"application": "a", "weight": 1}],
        "adapters": {"ad": {"versions": [{"version": 1, "weight": 90}, {"version": 2,
                                                                         "weight": 10}],
                            "rollout": {"steps": [50, 100]}}}}}})
    split = splits_of(cfg)["r:ad"]
    assert split.weighted == [("ad@v1", 90), ("ad@v2", 10)] and split.salt == "r:ad"
    assert split.rollout.steps == [50, 100]


def test_restore_from_saved_state():
    r = Rollout("smollm", "v1", "v2", POLICY, now=0)
    feed(r, "v1", 10)
    feed(r, "v2", 5)
    r.evaluate(30)
    again = Rollout.restore(r.to_dict())
    assert again.to_dict()["history"] == r.to_dict()["history"]
    assert (again.state, again.step, again.step_started_at, again.weights()) == \
        ("progressing", 1, 30, {"v1": 50, "v2": 50})
