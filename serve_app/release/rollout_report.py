"""Rollout report (``meshctl rollout-report``): a PNG and a short Markdown summary of a
progressive rollout, for a release record or a CI artifact.

Sources: the rollout's state and decision history from the router's ``GET /admin/rollouts``
(admin key), and the canary's and the stable arm's figures over time from Prometheus
(:mod:`serve_app.observability.prometheus`), per variant from the router's ``ray_mesh_*``
series: the error rate the rollout gates decide on (variant failures over the requests they
judge), the router's overload refusals as a line of their own (never counted against an
arm), TTFT p95 and latency p95. Each decision (start, advance, promote, rollback, ...) is
marked with its reason. Without Prometheus the report still has the decisions and the figures
the controller judged at each one.

The PNG is drawn with matplotlib, an optional extra of the package (:data:`REPORT_EXTRA`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serve_app.control.rollout import FINAL_STATES
from serve_app.observability.prometheus import PrometheusError, query_range

#: Reasons of the router's own overload refusals (503 before the request ran).
REFUSAL_REASONS = "overloaded|queue_timeout|shed"
#: How to install what draws the report: matplotlib, the package's ``report`` extra.
REPORT_EXTRA = "pip install 'serve-app[report]'"


class ReportError(RuntimeError):
    """The report cannot be drawn here; the message says how to fix it."""


def pyplot():
    """matplotlib's ``pyplot``, drawing to files only (the Agg backend).

    Raises:
        ReportError: matplotlib is not installed (it is the ``report`` extra:
            :data:`REPORT_EXTRA`).
    """
    try:
        import matplotlib
    except ImportError:
        raise ReportError(f"the report's PNG needs matplotlib, which is not installed: run "
                          f"{REPORT_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gated_error_rate(sel: str, by: str = "") -> str:
    """PromQL of the error rate the rollout gates decide on (0..1), from the router's series.

    Errors are variant failures, as :func:`serve_app.control.rollout.figures` counts them:
    failovers (the variant failed before the first byte) and streams it cut short
    (``stream_failed``). Requests are those the gates judge: answers below 400, and
    failovers. Not errors: 4xx, internal errors, clients hanging up, and the router's own
    overload refusals (:func:`refusal_rate`). Inside each ``sum``, ``or`` adds the two
    counters: their label sets never match (only errors carry ``kind``, only requests
    ``status``). In-band request and internal errors of a stream (status 200) stay in the
    requests, which the gates leave out: rare, they only lower the rate.

    Args:
        sel: label matchers, e.g. ``route="smollm",variant="smollm-v2"``.
        by: labels to keep (``sum by``), e.g. ``route, variant``; "" sums everything.
    """
    agg = f"sum by ({by})" if by else "sum"
    failures = (f"{agg} (rate(ray_mesh_failovers_total{{{sel}}}[1m]) or "
                f'rate(ray_mesh_errors_total{{{sel},kind="stream_failed"}}[1m]))')
    judged = (f'{agg} (rate(ray_mesh_requests_total{{{sel},status=~"[123].."}}[1m]) or '
              f"rate(ray_mesh_failovers_total{{{sel}}}[1m]))")
    return f"({failures} or {judged} * 0) / {judged}"


def refusal_rate(sel: str, by: str = "") -> str:
    """PromQL of the share of requests given to a variant that the router refused before
    they ran (0..1): 503 ``overloaded``, ``queue_timeout``, ``shed``. That is admission, not
    the variant's health, so the gates never count it. Arguments as :func:`gated_error_rate`."""
    agg = f"sum by ({by})" if by else "sum"
    refused = (f"{agg} (rate(ray_mesh_rejected_total{{{sel},"
               f'reason=~"{REFUSAL_REASONS}"}}[1m]))')
    given = f"{agg} (rate(ray_mesh_requests_total{{{sel}}}[1m]))"
    return f"({refused} or {given} * 0) / {given}"


def _p95(metric: str) -> Callable[[str], str]:
    return lambda sel: (f"histogram_quantile(0.95, sum by (le) "
                        f"(rate({metric}_bucket{{{sel}}}[1m])))")


#: (panel title, [(line, PromQL of an arm's label matchers)]) of the report's plots.
PLOTS: list[tuple[str, list[tuple[str, Callable[[str], str]]]]] = [
    ("errors, refusals (%)", [
        ("variant failures (gated)", lambda sel: f"100 * {gated_error_rate(sel)}"),
        ("router refusals (not gated)", lambda sel: f"100 * {refusal_rate(sel)}")]),
    ("TTFT p95 (s)", [("", _p95("ray_mesh_time_to_first_token_seconds"))]),
    ("latency p95 (s)", [("", _p95("ray_mesh_request_latency_seconds"))]),
]
DECISION_COLORS = {"start": "tab:gray", "shadow-pass": "tab:cyan", "advance": "tab:blue",
                   "promote": "tab:green",
                   "rollback": "tab:red", "abort": "tab:red", "pause": "tab:orange",
                   "resume": "tab:orange"}


@dataclass
class Report:
    """The files written: ``png``, ``markdown``."""

    png: Path
    markdown: Path


def fetch_rollouts(router_url: str, admin_key: str) -> dict[str, Any]:
    """``GET /admin/rollouts``: split key -> state and history.

    Raises:
        httpx.HTTPError: the router cannot be reached or refused the key.
    """
    r = httpx.get(f"{router_url.rstrip('/')}/admin/rollouts", timeout=30,
                  headers={"authorization": f"Bearer {admin_key}"})
    r.raise_for_status()
    return r.json()


def plot_queries(rollout: dict[str, Any]) -> dict[tuple[str, str, str], str]:
    """``(plot title, line, arm)`` -> PromQL, for both arms of a route's rollout (none for an
    adapter split, whose arms are adapter versions the series do not carry)."""
    if ":" in rollout["key"]:
        return {}
    return {(title, line, arm): promql(f'route="{rollout["key"]}",variant="{arm}"')
            for title, lines in PLOTS for line, promql in lines
            for arm in (rollout["stable"], rollout["canary"])}


Points = list[tuple[float, float]]


def series(prometheus: str | None, rollout: dict[str, Any], start: float, end: float
           ) -> dict[tuple[str, str, str], Points]:
    """``(plot title, line, arm)`` -> ``(time, value)`` points from Prometheus, for the
    queries of :func:`plot_queries` that answered (none without Prometheus)."""
    out: dict[tuple[str, str, str], Points] = {}
    if not prometheus:
        return out
    step = max(5.0, (end - start) / 200)
    for which, promql in plot_queries(rollout).items():
        try:
            result = query_range(prometheus, promql, start, end, step)
        except (PrometheusError, httpx.HTTPError):
            continue
        out[which] = [(float(t), float(v)) for r in result for t, v in r["values"]
                      if v not in ("NaN", "+Inf", "-Inf")]
    return out


def write_report(rollout: dict[str, Any], out_dir: Path, prometheus: str | None = None,
                 now: float | None = None) -> Report:
    """Write ``rollout-<key>.png`` and ``rollout-<key>.md`` into ``out_dir``.

    Args:
        rollout: one entry of ``/admin/rollouts`` (``key``, ``stable``, ``canary``,
            ``state``, ``history``, ...).
        prometheus: Prometheus base URL, for the figures over time.
        now: the report's end time, s since the epoch (default: now, or just after the last
            decision of a finished rollout).

    Raises:
        ReportError: matplotlib is not installed (:func:`pyplot`).
    """
    plt = pyplot()
    history = rollout["history"]
    start = history[0]["at"] - 30
    finished = rollout["state"] in FINAL_STATES
    end = now or (history[-1]["at"] + 30 if finished else time.time())
    data = series(prometheus, rollout, start, end)
    name = rollout["key"].replace(":", "-")
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, axes = plt.subplots(len(PLOTS) + 1, 1, figsize=(11, 10), sharex=True)
    t0 = history[0]["at"]
    weights = [(d["at"] - t0, d["canary_weight"]) for d in history] + \
        [(end - t0, history[-1]["canary_weight"])]
    axes[0].step([t for t, _ in weights], [w for _, w in weights], where="post",
                 color="tab:purple", lw=2)
    axes[0].set_ylabel("canary weight (%)")
    axes[0].set_ylim(-5, 105)
    for ax, (title, lines) in zip(axes[1:], PLOTS):
        for n, (line, _) in enumerate(lines):
            for arm, style in ((rollout["stable"], dict(color="tab:gray", lw=3, alpha=0.6)),
                               (rollout["canary"], dict(color="tab:purple", lw=1.5, ls="--"))):
                points = data.get((title, line, arm)) or []
                role = "stable" if arm == rollout["stable"] else "canary"
                if points:  # the stable arm is drawn wide, so a canary on top of it shows
                    ax.plot([t - t0 for t, _ in points], [v for _, v in points],
                            **{**style, **({"ls": ":"} if n else {})},  # refusals dotted
                            label=f"{role} {arm} {line}".rstrip())
        ax.set_ylabel(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no figures from Prometheus", transform=ax.transAxes,
                    ha="center", color="gray")
    for d in history:
        for ax in axes:
            ax.axvline(d["at"] - t0, color=DECISION_COLORS.get(d["decision"], "black"),
                       ls="--", lw=1)
        axes[0].annotate(f"{d['decision']} {d['canary_weight']}%", (d["at"] - t0, 102),
                         rotation=90, fontsize=8, va="top", ha="right",
                         color=DECISION_COLORS.get(d["decision"], "black"))
    axes[-1].set_xlabel("seconds since the rollout started")
    fig.suptitle(f"rollout {rollout['policy']['id']!r} of {rollout['key']}: "
                 f"{rollout['canary']} against {rollout['stable']} ({rollout['state']})")
    fig.tight_layout()
    png = out_dir / f"rollout-{name}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)

    md = out_dir / f"rollout-{name}.md"
    md.write_text(markdown(rollout, png.name))
    return Report(png, md)


def figures_text(f: dict[str, Any]) -> str:
    """A rollout figures dict (:func:`serve_app.control.rollout.figures`) in a few words."""
    ttft = f"{f['ttft_p95_ms']:.0f} ms" if f.get("ttft_p95_ms") is not None else "-"
    lat = f"{f['latency_p95_ms']:.0f} ms" if f.get("latency_p95_ms") is not None else "-"
    return f"{f['requests']} req, {f['error_rate']:.1%} err, TTFT p95 {ttft}, p95 {lat}"


def markdown(rollout: dict[str, Any], png_name: str) -> str:
    """The report's Markdown: outcome, policy, and one table row per decision."""
    history = rollout["history"]
    t0 = history[0]["at"]
    policy = rollout["policy"]
    lines = [
        f"# Rollout `{policy['id']}` of `{rollout['key']}`: {rollout['state']}",
        "",
        f"Canary `{rollout['canary']}` against stable `{rollout['stable']}`; steps "
        f"{policy['steps']} (percent), at least {policy['min_requests']} canary requests and "
        f"{policy['min_step_s']:g} s per step. Started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t0))}; final canary weight "
        f"{rollout['weights'][rollout['canary']]} %.",
        "",
        f"![rollout]({png_name})",
        "",
        "Errors are variant failures (a failover before the first byte, a stream cut short) "
        "over the requests the gates judge, as the controller counts them; the router's "
        "overload refusals (503 `overloaded`, `queue_timeout`, `shed`) are plotted apart and "
        "never count against an arm.",
        "",
        "| at | decision | canary weight | reason | canary (step) | stable |",
        "|---|---|---|---|---|---|",
    ]
    for d in history:
        lines.append(f"| +{d['at'] - t0:.0f} s | {d['decision']} | {d['canary_weight']} % | "
                     f"{d['reason']} | {figures_text(d['canary'])} | "
                     f"{figures_text(d['stable'])} |")
    return "\n".join(lines) + "\n"
