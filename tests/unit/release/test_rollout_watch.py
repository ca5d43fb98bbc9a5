"""Unit tests of ``meshctl rollout status`` (serve_app.release.rollout_watch): new decisions
and verdicts from successive ``/admin/rollouts`` snapshots, the poll loop with a fake fetch
and clock, the exit codes, and the CLI wiring against a fake router (httpx MockTransport).

Snapshots come from the real ``Rollout`` state machine (serve_app.control.rollout) driven
with a fake clock, so they have exactly the router's shape."""

from __future__ import annotations

import httpx
import pytest

from serve_app import cli
from serve_app.common.policies import RolloutGates, RolloutPolicy
from serve_app.control.rollout import Observation, Rollout
from serve_app.release import rollout_watch
from serve_app.release.rollout_watch import (ABORTED, IN_PROGRESS, PROMOTED, ROLLED_BACK,
                                             TIMEOUT, UNREACHABLE, USAGE, Unreachable,
                                             Watcher, decision_line, watch)
from tests.support.clocks import FakeClock

POLICY = RolloutPolicy(id="release-7", steps=[50, 100], min_requests=2, min_step_s=10,
                       gates=RolloutGates(max_error_rate_increase=0.1))


def feed(r: Rollout, arm: str, n: int, *, error: bool = False) -> None:
    for _ in range(n):
        r.observe(Observation("smollm", arm, error, False, 0.1, 0.5))


def snapshot(*rollouts: Rollout) -> dict:
    return {r.key: r.to_dict() for r in rollouts}


def promoted_run() -> list[dict]:
    """Snapshots of a rollout that advances, then promotes (clock: 1000 s on)."""
    r = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    snaps = [snapshot(r)]
    feed(r, "v1", 5)
    feed(r, "v2", 2)
    r.evaluate(1010)
    snaps.append(snapshot(r))
    snaps.append(snapshot(r))  # nothing new
    feed(r, "v2", 2)
    r.evaluate(1020)
    snaps.append(snapshot(r))
    return snaps


def run(snaps, **kw):
    """watch() over a list of snapshots (or exceptions to raise); the last one repeats."""
    clock, lines, calls = FakeClock(), [], iter(range(10**6))

    def fetch():
        item = snaps[min(next(calls), len(snaps) - 1)]
        if isinstance(item, Exception):
            raise item
        return item
    code, last = watch(fetch, clock=clock, sleep=clock.sleep, out=lines.append,
                       interval_s=kw.pop("interval_s", 1), **kw)
    return code, last, lines


def test_watcher_reports_each_decision_once_and_the_verdict():
    snaps = promoted_run()
    w = Watcher()
    ups = [w.update(s) for s in snaps]
    assert [len(u.lines) for u in ups] == [1, 1, 0, 1]
    assert [u.code for u in ups] == [None, None, None, PROMOTED]
    assert "smollm step 1 advance: canary 100% / stable 0%; every gate held at 50%" in \
        ups[1].lines[0]
    assert "promote" in ups[3].lines[0]


def test_decision_line_has_time_split_step_weights_reason_and_figures():
    r = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    feed(r, "v1", 4)
    feed(r, "v2", 2, error=True)
    d = r.evaluate(1001)
    line = decision_line("smollm", d)
    assert line.startswith("1970-01-01T00:16:41Z smollm step 0 rollback: canary 0% / stable "
                           "100%; error rate 100.0% vs stable 0.0% (+100.0% > +10.0%); ")
    assert "canary 2 req, 100.0% err" in line and "stable 4 req, 0.0% err" in line


@pytest.mark.parametrize("end, code", [("promote", PROMOTED), ("rollback", ROLLED_BACK),
                                       ("abort", ABORTED)])
def test_watch_exits_with_the_code_of_the_verdict(end, code):
    r = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    first = snapshot(r)
    feed(r, "v1", 5)
    if end == "promote":
        r.policy = RolloutPolicy(**{**POLICY.model_dump(), "steps": [100]})
        r.step = 0
        feed(r, "v2", 2)
        r.evaluate(1010)
    elif end == "rollback":
        feed(r, "v2", 2, error=True)
        r.evaluate(1010)
    else:
        r.apply_policy(RolloutPolicy(**{**POLICY.model_dump(), "abort": True}), 1010)
    got, last, lines = run([first, first, snapshot(r)])
    assert got == code and last["state"] == {"promote": "promoted", "rollback": "rolled_back",
                                             "abort": "aborted"}[end]
    assert [line.split()[4].rstrip(":") for line in lines[:2]] == ["start", end]
    assert lines[-1].startswith(f"smollm: {last['state']} (rollout 'release-7', step ")


def test_a_rollout_removed_or_replaced_by_a_deploy_is_aborted():
    r = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    code, _, lines = run([snapshot(r), {}])
    assert code == ABORTED and "the rollout is gone" in lines[-1]
    other = Rollout("smollm", "v1", "v3", POLICY, now=1100)
    code, last, lines = run([snapshot(r), snapshot(other)])
    assert code == ABORTED and "replaced by a deploy" in lines[-1]
    assert last["canary"] == "v2"  # the report is of the rollout that was watched


def test_a_restart_with_the_same_id_is_followed_from_its_new_history():
    r = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    again = Rollout("smollm", "v1", "v2", POLICY, now=1200)
    again.apply_policy(RolloutPolicy(**{**POLICY.model_dump(), "abort": True}), 1201)
    code, _, lines = run([snapshot(r), snapshot(again)])
    assert code == ABORTED
    assert "started again" in lines[1] and lines[2].split()[4] == "start:"


def test_without_watch_it_reads_once_and_in_progress_has_its_own_code():
    snaps = promoted_run()
    code, last, lines = run(snaps, follow=False)
    assert code == IN_PROGRESS and last["state"] == "progressing"
    assert lines[-1] == ("smollm: progressing (rollout 'release-7', step 0 of steps "
                         "[50, 100]); weights v1 50%, v2 50%")
    code, _, _ = run(snaps[-1:], follow=False)
    assert code == PROMOTED


def test_timeout():
    r = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    code, _, lines = run([snapshot(r)], timeout_s=30, interval_s=2)
    assert code == TIMEOUT and lines[-1].startswith("timed out after 30 s without a verdict; ")


def test_several_rollouts_need_split_and_a_missing_split_is_a_usage_error():
    a = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    b = Rollout("smollm:acme", "acme@v1", "acme@v2", POLICY, now=1000)
    code, _, lines = run([snapshot(a, b)], follow=False)
    assert code == USAGE and "choose one with --split" in lines[0]
    code, last, _ = run([snapshot(a, b)], follow=False, split="smollm:acme")
    assert code == IN_PROGRESS and last["key"] == "smollm:acme"
    # Watching, a split not there yet is waited for (just deployed), then refused.
    code, _, lines = run([{}], split="smollm", grace_s=10)
    assert code == USAGE and lines == ["no rollout of split 'smollm' (rollouts: none)"]
    code, _, _ = run([{}, {}, snapshot(a, b)], split="smollm", timeout_s=5)
    assert code == TIMEOUT


def test_unreachable_is_retried_while_watching_but_a_refused_key_is_not():
    r = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    r.apply_policy(RolloutPolicy(**{**POLICY.model_dump(), "abort": True}), 1010)
    down = Unreachable("connection refused")
    code, _, _ = run([down, down, snapshot(r)])
    assert code == ABORTED
    code, _, lines = run([down], grace_s=5)
    assert code == UNREACHABLE and "connection refused" in lines[-1]
    code, _, _ = run([down], follow=False)
    assert code == UNREACHABLE
    code, _, _ = run([Unreachable("401", fatal=True), snapshot(r)])
    assert code == UNREACHABLE


def fake_router(monkeypatch, answers):
    """Route rollout_report.fetch_rollouts' httpx.get to ``answers`` (status, body), in turn."""
    seen = iter(answers)

    def get(url, timeout, headers):
        status, body = next(seen)
        assert url == "http://mesh:8000/admin/rollouts"
        assert headers == {"authorization": "Bearer sk-admin"}
        return httpx.Response(status, json=body, request=httpx.Request("GET", url))
    monkeypatch.setattr(httpx, "get", get)


def test_cli_exit_codes_and_report(monkeypatch, tmp_path, capsys):
    snaps = promoted_run()
    base = ["rollout", "status", "--router-url", "http://mesh:8000", "--admin-key", "sk-admin",
            "--prometheus", ""]
    monkeypatch.setattr(rollout_watch.time, "sleep", lambda s: None)
    fake_router(monkeypatch, [(200, s) for s in snaps])
    assert cli.main([*base, "--watch", "--timeout", "60", "--interval", "0.01",
                     "--report", str(tmp_path)]) == PROMOTED
    out = capsys.readouterr().out
    assert out.count(" smollm step ") == 3 and out.rstrip().endswith("exit 0 (promoted)")
    assert (tmp_path / "rollout-smollm.md").read_text().startswith(
        "# Rollout `release-7` of `smollm`: promoted")
    assert (tmp_path / "rollout-smollm.png").exists()
    fake_router(monkeypatch, [(401, {"error": {"message": "invalid API key"}})])
    assert cli.main([*base, "--watch"]) == UNREACHABLE
    assert "answered 401" in capsys.readouterr().out
    fake_router(monkeypatch, [(200, snaps[1])])
    assert cli.main(base) == IN_PROGRESS
    assert cli.main([*base, "--watch", "--timeout", "0"]) == USAGE


def test_a_deploys_rollout_id_is_awaited_so_the_previous_verdict_is_not_taken_for_it():
    """A deploy whose rollout the mesh has not taken yet (the controller still holds the
    promoted rollout of the release before) is waited for, not reported as promoted."""
    old = Rollout("smollm", "v1", "v2", POLICY, now=1000)
    feed(old, "v1", 5)
    feed(old, "v2", 2)
    old.evaluate(1010)
    feed(old, "v2", 2)
    old.evaluate(1020)
    assert old.state == "promoted"
    new = Rollout("smollm", "v1", "v2", POLICY.model_copy(update={"id": "release-8"}),
                  now=1030)
    reads = [snapshot(old), snapshot(old)]  # then the new one, from the third read on
    clock, lines = FakeClock(), []
    code, last = watch(lambda: reads.pop(0) if reads else snapshot(new), expect_id="release-8",
                       clock=clock, sleep=clock.sleep, out=lines.append, timeout_s=5)
    assert code == TIMEOUT and last["policy"]["id"] == "release-8", lines
    assert not any("promote" in line for line in lines)
    # Never there within the grace period: a usage error naming both ids.
    clock, lines = FakeClock(), []
    code, _ = watch(lambda: snapshot(old), expect_id="release-8", clock=clock,
                    sleep=clock.sleep, out=lines.append)
    assert code == USAGE and "runs rollout 'release-7', not 'release-8'" in lines[-1]


def test_declared_rollouts_of_a_shipped_config():
    from serve_app.common.paths import REPO_ROOT
    from serve_app.common.serve_configs import load_yaml

    def declared(name: str) -> dict[str, str]:
        return rollout_watch.declared_rollouts(load_yaml(REPO_ROOT / "serve_configs" / name))

    assert list(declared("rollout.yaml")) == ["smollm"] and declared("rollout.yaml")["smollm"]
    assert declared("local.yaml") == {}
