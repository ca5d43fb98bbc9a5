"""Rollout report (``meshctl rollout-report``): a PNG and a short Markdown summary of a
progressive rollout, for a release record or a CI artifact.

Sources: the rollout's state and decision history from the router's ``GET /admin/rollouts``
(admin key), and the canary's and the stable arm's figures over time from Prometheus
(:mod:`serve_app.tools.prometheus`): error rate, TTFT p95 and latency p95 per variant, from
the router's ``ray_mesh_*`` series. Each decision (start, advance, promote, rollback, ...) is
marked with its reason. Without Prometheus the report still has the decisions and the figures
the controller judged at each one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serve_app.tools.prometheus import PrometheusError, query_range

#: (panel title, PromQL with {arm} and {route}, unit scale) of the report's plots.
PLOTS = [
    ("error rate (%)",
     '100 * (sum(rate(ray_mesh_errors_total{{route="{route}",variant="{arm}",'
     'kind!~"http_4..|client_disconnected|request_error"}}[1m])) or vector(0)) / '
     'sum(rate(ray_mesh_requests_total{{route="{route}",variant="{arm}"}}[1m]))'),
    ("TTFT p95 (s)", 'histogram_quantile(0.95, sum by (le) (rate('
     'ray_mesh_time_to_first_token_seconds_bucket{{route="{route}",variant="{arm}"}}[1m])))'),
    ("latency p95 (s)", 'histogram_quantile(0.95, sum by (le) (rate('
     'ray_mesh_request_latency_seconds_bucket{{route="{route}",variant="{arm}"}}[1m])))'),
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


def series(prometheus: str | None, rollout: dict[str, Any], start: float, end: float
           ) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per plot title, per arm: ``(time, value)`` points from Prometheus (empty without it, or
    for an adapter split, whose arms are adapter versions the series do not carry)."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {t: {} for t, _ in PLOTS}
    if not prometheus or ":" in rollout["key"]:
        return out
    step = max(5.0, (end - start) / 200)
    for title, promql in PLOTS:
        for arm in (rollout["stable"], rollout["canary"]):
            try:
                result = query_range(prometheus, promql.format(route=rollout["key"], arm=arm),
                                     start, end, step)
            except (PrometheusError, httpx.HTTPError):
                continue
            points = [(float(t), float(v)) for r in result for t, v in r["values"]
                      if v not in ("NaN", "+Inf", "-Inf")]
            out[title][arm] = points
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
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = rollout["history"]
    start = history[0]["at"] - 30
    finished = rollout["state"] not in ("progressing", "paused")
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
    for ax, (title, _) in zip(axes[1:], PLOTS):
        for arm, style in ((rollout["stable"], dict(color="tab:gray", lw=3, alpha=0.6)),
                           (rollout["canary"], dict(color="tab:purple", lw=1.5, ls="--"))):
            points = data[title].get(arm) or []
            role = "stable" if arm == rollout["stable"] else "canary"
            if points:  # the stable arm is drawn wide, so a canary on top of it shows
                ax.plot([t - t0 for t, _ in points], [v for _, v in points], **style,
                        label=f"{role} {arm}")
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


def _figures(f: dict[str, Any]) -> str:
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
        "| at | decision | canary weight | reason | canary (step) | stable |",
        "|---|---|---|---|---|---|",
    ]
    for d in history:
        lines.append(f"| +{d['at'] - t0:.0f} s | {d['decision']} | {d['canary_weight']} % | "
                     f"{d['reason']} | {_figures(d['canary'])} | {_figures(d['stable'])} |")
    return "\n".join(lines) + "\n"
