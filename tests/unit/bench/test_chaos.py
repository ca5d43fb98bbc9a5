"""The chaos drill's judgement (bench/chaos.py) on made-up outcomes, and its changes."""

from __future__ import annotations

from bench.chaos import EVENTS, Event, Outcome, change, chaos_config, verdicts
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml


def ok(loop, started, ended, stream=False, replica="r1"):
    return Outcome(loop, stream, started, ended, 200, True, "", "smollm-v1", replica)


def failed(loop, started, ended, stream=False, replica="r1"):
    return Outcome(loop, stream, started, ended, 500, False, "boom", "smollm-v1", replica)


def test_a_change_window_allows_no_failure():
    events = [Event("weights", 10.0), Event("adapter_flip", 20.0)]
    w = verdicts(events, [ok("a", 11, 12), failed("b", 12, 13), ok("c", 21, 22)])
    assert not w[0].held and "1 failed" in w[0].problems[0]
    assert w[1].held and w[1].answered == 1


def test_a_killed_replica_may_lose_only_its_streams_in_flight():
    kill = Event("kill_variant_replica", 10.0, replica="r1")
    lost_stream = failed("s", 9, 10.5, stream=True, replica="r1")
    assert verdicts([kill], [lost_stream, ok("n", 11, 12)])[0].held
    other_replica = failed("s", 9, 10.5, stream=True, replica="r2")
    lost_non_stream = failed("n", 9, 10.5, replica="r1")
    for stray in (other_replica, lost_non_stream):
        w = verdicts([kill], [stray, ok("n", 11, 12)])[0]
        assert not w.held and w.allowed == 0, w.problems


def test_a_killed_router_may_lose_what_was_in_flight_and_must_be_back_in_10_s():
    kill = Event("kill_router_replica", 10.0)
    w = verdicts([kill], [failed("a", 9, 10.2), ok("b", 10.5, 11)])[0]
    assert w.held and w.allowed == 1 and w.service_back_s == 1.0
    after = verdicts([kill], [failed("a", 10.1, 10.2), ok("b", 10.5, 11)])[0]
    assert not after.held  # it started after the kill: not in flight on the dead router
    late = verdicts([kill], [ok("b", 10.5, 21)])[0]
    assert not late.held and late.service_back_s == 11.0


def test_a_failure_belongs_to_the_event_before_its_end():
    """A stream started after a change and cut by the next event, a kill, is the kill's."""
    events = [Event("weights", 10.0), Event("kill_variant_replica", 20.0, replica="r1")]
    cut = failed("s", 15, 20.5, stream=True, replica="r1")
    w = verdicts(events, [cut, ok("n", 21, 22)])
    assert w[0].held and w[1].held and w[1].failed == [cut]


def test_each_change_is_undone_by_its_next_turn():
    cfg = chaos_config(load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml"))
    for kind in EVENTS:
        if kind.startswith("kill_") or kind.startswith("adapter_"):
            continue
        once, what = change(cfg, kind)
        twice, _ = change(once, kind)
        assert once != cfg and twice == cfg, (kind, what)
    removed, _ = change(cfg, "adapter_remove")
    assert change(removed, "adapter_add")[0] == cfg
