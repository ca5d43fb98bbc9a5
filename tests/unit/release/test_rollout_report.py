"""Unit test of the rollout report (no cluster, no Prometheus): the PNG and the Markdown
from a rollout's decision history."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from serve_app.release.rollout_report import (ReportError, markdown, plot_queries, series,
                                              write_report)
from tests.support.dashboard import dashboard


def figures(requests, errors=0, ttft=None, latency=None):
    return {"requests": requests, "errors": errors, "error_rate": errors / requests
            if requests else 0.0, "truncated": 0, "samples": requests - errors,
            "ttft_p95_ms": ttft, "latency_p95_ms": latency}


ROLLOUT = {
    "key": "smollm", "stable": "smollm-v1", "canary": "smollm-v2", "state": "rolled_back",
    "weights": {"smollm-v1": 100, "smollm-v2": 0},
    "policy": {"id": "release-7", "steps": [25, 50, 100], "min_requests": 4, "min_step_s": 2},
    "history": [
        {"at": 1000.0, "decision": "start", "canary_weight": 25, "reason": "rollout started",
         "canary": figures(0), "stable": figures(0)},
        {"at": 1030.0, "decision": "advance", "canary_weight": 50,
         "reason": "every gate held at 25%", "canary": figures(5, 0, 300, 900),
         "stable": figures(12, 0, 280, 850)},
        {"at": 1055.0, "decision": "rollback", "canary_weight": 0,
         "reason": "error rate 80.0% vs stable 0.0%", "canary": figures(5, 4, 310, 950),
         "stable": figures(20, 0, 290, 860)},
    ],
}


def test_report_files_and_markdown(tmp_path):
    report = write_report(ROLLOUT, tmp_path)
    assert report.png.name == "rollout-smollm.png" and report.png.stat().st_size > 20_000
    assert report.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.markdown.read_text()
    assert text.startswith("# Rollout `release-7` of `smollm`: rolled_back")
    assert "![rollout](rollout-smollm.png)" in text
    assert ("| +55 s | rollback | 0 % | error rate 80.0% vs stable 0.0% | 5 req, 80.0% err, "
            "TTFT p95 310 ms, p95 950 ms | 20 req, 0.0% err, TTFT p95 290 ms, p95 860 ms |"
            in text)
    assert markdown(ROLLOUT, "x.png").count("\n| +") == 3


# -- matplotlib is an optional extra -------------------------------------------------------------

@pytest.fixture
def without_matplotlib(monkeypatch):
    """``import matplotlib`` fails, as where the package is installed without its extra."""
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)


def test_without_matplotlib_the_report_says_how_to_install_it(without_matplotlib, tmp_path):
    with pytest.raises(ReportError, match=r"matplotlib.*pip install 'serve-app\[report\]'"):
        write_report(ROLLOUT, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_meshctl_rollout_report_without_matplotlib_is_one_line(without_matplotlib, tmp_path,
                                                                monkeypatch, capsys):
    from serve_app import cli
    from serve_app.commands import observe

    monkeypatch.setattr(observe, "fetch_rollouts", lambda url, key: {"smollm": ROLLOUT})
    code = cli.main(["rollout-report", "--out", str(tmp_path), "--prometheus", ""])
    assert code == cli.USAGE_EXIT
    assert capsys.readouterr().err.splitlines() == [
        "meshctl rollout-report: the report's PNG needs matplotlib, which is not installed: "
        "run pip install 'serve-app[report]'"]


# -- the figures over time: which series each plotted line is made of -----------------------

ROUTE = {**ROLLOUT, "state": "progressing"}


def test_plotted_error_rate_is_the_gated_one_and_refusals_are_a_line_of_their_own():
    q = plot_queries(ROUTE)
    assert sorted({(title, line) for title, line, _ in q}) == [
        ("TTFT p95 (s)", ""), ("errors, refusals (%)", "router refusals (not gated)"),
        ("errors, refusals (%)", "variant failures (gated)"), ("latency p95 (s)", "")]
    errors = q[("errors, refusals (%)", "variant failures (gated)", "smollm-v1")]
    assert 'route="smollm",variant="smollm-v1"' in errors and "smollm-v2" not in errors
    assert "ray_mesh_failovers_total" in errors and 'kind="stream_failed"' in errors
    assert "overloaded" not in errors and "ray_mesh_rejected_total" not in errors
    refusals = q[("errors, refusals (%)", "router refusals (not gated)", "smollm-v1")]
    assert 'ray_mesh_rejected_total{route="smollm",variant="smollm-v1",' \
           'reason=~"overloaded|queue_timeout|shed"}' in refusals
    # An adapter split's arms are adapter versions: the router's series do not carry them.
    assert plot_queries({**ROUTE, "key": "smollm:acme", "stable": "acme@v1",
                         "canary": "acme@v2"}) == {}


def test_series_keeps_each_line_apart(monkeypatch, tmp_path):
    from serve_app.release import rollout_report

    asked = []

    def query_range(url, promql, start, end, step):
        asked.append(promql)
        value = "7" if "rejected" in promql and "smollm-v1" in promql else "NaN"
        return [{"metric": {}, "values": [[start, value], [end, value]]}]
    monkeypatch.setattr(rollout_report, "query_range", query_range)
    data = series("http://prometheus", ROUTE, 1000, 1100)
    assert len(asked) == len(plot_queries(ROUTE)) == 8
    assert data[("errors, refusals (%)", "router refusals (not gated)", "smollm-v1")] == [
        (1000.0, 7.0), (1100.0, 7.0)]
    assert data[("errors, refusals (%)", "variant failures (gated)", "smollm-v1")] == []
    assert write_report(ROUTE, tmp_path, "http://prometheus", now=1100).png.exists()


def promtool_check(series_values: dict[str, str], expectations: list[tuple[str, dict]]):
    """Evaluate PromQL over made-up counters with ``promtool test rules`` (Prometheus' own
    engine, no server): each ``(expr, {labels: value})`` at 4 min, values rounded to 1e-4."""
    import shutil
    import subprocess
    import tempfile

    import yaml

    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (scripts/install_services.sh)")
    test = {"rule_files": [], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": s, "values": v} for s, v in series_values.items()],
        "promql_expr_test": [{
            "expr": f"round({expr}, 0.0001)", "eval_time": "4m",
            "exp_samples": [{"labels": labels, "value": value}
                            for labels, value in want.items()]}
            for expr, want in expectations]}]}
    path = Path(tempfile.mkdtemp()) / "promql_test.yml"
    path.write_text(yaml.safe_dump(test))
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


#: Counters per 15 s, like the router's: the stable arm answers 8 and the router refuses 2
#: for overload (503 overloaded) and 1 bad request (400); the canary answers 6 (one of them a
#: stream its engine cut short) and fails 1 over; a second canary only fails over. Ray's own
#: labels (WorkerId) differ per router replica.
COUNTERS = {
    'ray_mesh_requests_total{route="smollm",variant="smollm-v1",status="200",WorkerId="a"}':
        "0+8x20",
    'ray_mesh_requests_total{route="smollm",variant="smollm-v1",status="503",WorkerId="a"}':
        "0+2x20",
    'ray_mesh_requests_total{route="smollm",variant="smollm-v1",status="400",WorkerId="b"}':
        "0+1x20",
    'ray_mesh_errors_total{route="smollm",variant="smollm-v1",kind="overloaded",WorkerId="a"}':
        "0+2x20",
    'ray_mesh_errors_total{route="smollm",variant="smollm-v1",kind="http_400",WorkerId="b"}':
        "0+1x20",
    'ray_mesh_rejected_total{route="smollm",variant="smollm-v1",reason="overloaded",'
    'WorkerId="a"}': "0+2x20",
    'ray_mesh_requests_total{route="smollm",variant="smollm-v2",status="200",WorkerId="a"}':
        "0+6x20",
    'ray_mesh_errors_total{route="smollm",variant="smollm-v2",kind="stream_failed",'
    'WorkerId="a"}': "0+1x20",
    'ray_mesh_failovers_total{route="smollm",variant="smollm-v2",WorkerId="b"}': "0+1x20",
    'ray_mesh_failovers_total{route="smollm",variant="smollm-v3",WorkerId="a"}': "0+3x20",
}


def test_the_queries_compute_the_gates_error_rate_in_prometheus():
    """The gates see the stable arm's 8 answers without error (the refusals are no
    observation) and the canary's 2 variant failures in 7 observations (6 answers + 1
    failover): 0 % and 28.57 %. The refusals are 2 of the 11 requests given to stable."""
    q = plot_queries(ROUTE)
    err, ref = "variant failures (gated)", "router refusals (not gated)"
    third = plot_queries({**ROUTE, "stable": "smollm-v3"})
    promtool_check(COUNTERS, [
        (q[("errors, refusals (%)", err, "smollm-v1")], {"{}": 0}),
        (q[("errors, refusals (%)", err, "smollm-v2")], {"{}": 28.5714}),
        (q[("errors, refusals (%)", ref, "smollm-v1")], {"{}": 18.1818}),
        (q[("errors, refusals (%)", ref, "smollm-v2")], {"{}": 0}),
        (third[("errors, refusals (%)", err, "smollm-v3")], {"{}": 100}),
    ])


def test_the_dashboard_panel_computes_the_same_rates():
    build = dashboard()
    panel = "Variant failure rate (as rollouts gate) and router refusals"
    exprs = {title: e for title, e in build.queries() if title.startswith(panel)}
    assert len(exprs) == 2
    failures = exprs[f"{panel}: failures {{{{route}}}} {{{{variant}}}}"]
    refused = exprs[f"{panel}: refused {{{{route}}}} {{{{variant}}}}"]
    assert "http_4" not in failures and "overloaded" not in failures
    v = '{{route="smollm",variant="{}"}}'.format
    promtool_check(COUNTERS, [
        (failures, {v("smollm-v1"): 0, v("smollm-v2"): 0.2857, v("smollm-v3"): 1}),
        (refused, {v("smollm-v1"): 0.1818, v("smollm-v2"): 0}),
    ])


def test_the_dashboards_share_of_service_weighs_tokens_as_fair_admission_does():
    """Tenant a: 10 prompt + 10 completion tokens/s (service 30); b: 30 + 10 (service 50),
    over two router replicas: shares 0.375 and 0.625."""
    build = dashboard()
    [share] = [e for title, e in build.queries() if title.startswith("Share of service")]
    per_15s = {'ray_mesh_prompt_tokens_total{tenant="a",WorkerId="x"}': "0+150x20",
               'ray_mesh_prompt_tokens_total{tenant="b",WorkerId="x"}': "0+300x20",
               'ray_mesh_prompt_tokens_total{tenant="b",WorkerId="y"}': "0+150x20",
               'ray_mesh_completion_tokens_total{tenant="a",WorkerId="y"}': "0+150x20",
               'ray_mesh_completion_tokens_total{tenant="b",WorkerId="x"}': "0+150x20"}
    promtool_check(per_15s, [(share, {'{tenant="a"}': 0.375, '{tenant="b"}': 0.625})])
