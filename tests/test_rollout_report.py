"""Unit test of the rollout report (no cluster, no Prometheus): the PNG and the Markdown
from a rollout's decision history."""

from __future__ import annotations

from serve_app.release.rollout_report import markdown, write_report


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
