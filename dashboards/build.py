#!/usr/bin/env python
"""Build the model mesh's Grafana dashboard (``dashboards/model-mesh.json``) with grafanalib.

    .venv/bin/python dashboards/build.py          # rewrite dashboards/model-mesh.json
    .venv/bin/python dashboards/build.py --check  # exit 1 if the JSON is not what this builds

Every panel is a PromQL query over the series the mesh exports through Ray's metrics:
``ray_mesh_*`` (the router), ``ray_vllm_*`` (each variant's engine, labelled ``variant``).
``tests/integration/test_observability.py`` runs every query against a real Prometheus
scraping a mesh under load and requires each one to return data, so the dashboard cannot rot
silently.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (Annotations, Dashboard, GridPos, RowPanel, Target, Template,
                             Templating, TimeSeries)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.script_args import run, script_parser  # noqa: E402
from serve_app.release.rollout_report import gated_error_rate, refusal_rate  # noqa: E402

OUT = Path(__file__).resolve().parent / "model-mesh.json"
DS = "${DS_PROMETHEUS}"
BY = "route, variant"
SEL = 'route=~"$route"'  # the route picker (every series of the router carries `route`)


#: Each tenant's service rate (tokens/s), weighted as token-fair admission weighs it
#: (serve_app/admission/variant_queue.py: PROMPT_WEIGHT 1, COMPLETION_WEIGHT 2).
SERVICE = ("(sum by (tenant) (rate(ray_mesh_prompt_tokens_total[5m])) + 2 * sum by (tenant) "
           "(rate(ray_mesh_completion_tokens_total[5m])))")


def p95(metric: str, by: str = BY, selector: str = SEL, q: float = 0.95) -> str:
    return (f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate({metric}_bucket{{{selector}}}[1m])))")


#: The row of variants that scale to zero: tests/integration/test_scale_to_zero.py checks its
#: queries (it has the cold starts); tests/integration/test_observability.py checks every
#: other row.
SCALE_TO_ZERO_ROW = ("Scale to zero: variant states, cold starts and the resident budget "
                     "(serve_app/variants/cold_start.py)")

#: (row, [(title, unit, [(PromQL, legend)])]) in dashboard order.
PANELS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Traffic, per route and variant (the router's view)", [
        ("Requests per second", "reqps", [
            (f"sum by ({BY}) (rate(ray_mesh_requests_total{{{SEL}}}[1m]))",
             "{{route}} {{variant}}")]),
        # The rate the rollout gates decide on; the router's overload refusals apart.
        ("Variant failure rate (as rollouts gate) and router refusals", "percentunit", [
            (gated_error_rate(SEL, BY), "failures {{route}} {{variant}}"),
            (refusal_rate(SEL, BY), "refused {{route}} {{variant}}")]),
        ("Time to first token", "s", [
            (p95("ray_mesh_time_to_first_token_seconds", q=0.5), "p50 {{variant}}"),
            (p95("ray_mesh_time_to_first_token_seconds"), "p95 {{variant}}")]),
        ("Inter-token latency p95", "s", [
            (p95("ray_mesh_inter_token_latency_seconds"), "{{variant}}")]),
        ("Request latency p95", "s", [
            (p95("ray_mesh_request_latency_seconds"), "{{variant}}")]),
        ("Generated tokens per second", "short", [
            (f"sum by ({BY}) (rate(ray_mesh_completion_tokens_total{{{SEL}}}[1m]))",
             "{{variant}}")]),
    ]),
    ("Releases: rollouts and adapters", [
        ("Canary weight (rollout decisions as annotations)", "percent", [
            ("max by (rollout) (ray_mesh_rollout_canary_weight)", "{{rollout}}")]),
        ("Rollout decisions", "short", [
            ("sum by (rollout, decision) (increase(ray_mesh_rollout_decisions_total[5m]))",
             "{{rollout}} {{decision}}")]),
        ("Adapter events (loaded, unloaded, refused)", "short", [
            ('sum by (variant, adapter, event) (increase(ray_mesh_adapter_events_total'
             '{event=~"loaded|unloaded|refused"}[1h]))', "{{variant}} {{adapter}} {{event}}")]),
    ]),
    ("Adapters: declared, resident, placed (serve_app/server/lora.py)", [
        ("Adapters resident per replica", "short", [
            ("max by (variant, replica) (ray_mesh_adapters_resident)",
             "{{variant}} {{replica}}")]),
        ("Adapter loads, evictions and requests that waited for a load", "short", [
            ('sum by (variant, event) (increase(ray_mesh_adapter_events_total'
             '{event=~"loaded|evicted|waited"}[5m]))', "{{variant}} {{event}}")]),
        # hit: the request's adapter was resident where the replica router sent it
        ("Adapter-affinity hit rate", "percentunit", [
            ('sum by (variant) (rate(ray_mesh_adapter_events_total{event="hit"}[5m])) / '
             'sum by (variant) (rate(ray_mesh_adapter_events_total{event=~"hit|waited"}[5m]))',
             "{{variant}}")]),
        ("Adapter load time p95 (first use)", "s", [
            ("histogram_quantile(0.95, sum by (le, variant) "
             "(rate(ray_mesh_adapter_load_seconds_bucket[1h])))", "{{variant}}")]),
        ("Tokens per adapter, top 10 (prompt + completion, tokens/s)", "short", [
            ('topk(10, sum by (adapter) (rate(ray_mesh_prompt_tokens_total{adapter!=""}[5m])) '
             '+ sum by (adapter) (rate(ray_mesh_completion_tokens_total{adapter!=""}[5m])))',
             "{{adapter}}")]),
    ]),
    ("Tenants and admission", [
        ("Tenant rejections (401 / 403 / 429)", "short", [
            ('sum by (tenant, status) (increase(ray_mesh_requests_total{status=~"401|403|429"}'
             "[5m]))", "{{tenant}} {{status}}")]),
        ("Refused before running, by reason", "short", [
            ("sum by (route, reason) (increase(ray_mesh_rejected_total[5m]))",
             "{{route}} {{reason}}")]),
        ("Wait for an admission slot p95", "s", [
            (p95("ray_mesh_queue_time_seconds"), "{{variant}}")]),
        ("Token budgets: reserved at admission vs used (tokens/s)", "short", [
            ("sum by (tenant) (rate(ray_mesh_tenant_tokens_reserved_total[5m]))",
             "reserved {{tenant}}"),
            ("sum by (tenant) (rate(ray_mesh_tenant_tokens_used_total[5m]))",
             "used {{tenant}}")]),
        ("Token budget remaining (after each tenant's last admitted request)", "short", [
            ("min by (tenant) (ray_mesh_tenant_tokens_remaining)", "{{tenant}}")]),
        ("Share of service per tenant (prompt + 2 x completion tokens, the fair order's "
         "weights)", "percentunit", [
            (f"{SERVICE} / scalar(sum({SERVICE}))", "{{tenant}}")]),
    ]),
    ("Engines (vLLM's own metrics, per variant)", [
        ("Requests running / waiting in vLLM", "short", [
            ("sum by (variant) (ray_vllm_num_requests_running)", "running {{variant}}"),
            ("sum by (variant) (ray_vllm_num_requests_waiting)", "waiting {{variant}}")]),
        ("KV cache usage", "percentunit", [
            ("max by (variant) (ray_vllm_kv_cache_usage_perc)", "{{variant}}")]),
        ("Engine TTFT / inter-token latency p95", "s", [
            (p95("ray_vllm_time_to_first_token_seconds", "variant", ""), "TTFT {{variant}}"),
            (p95("ray_vllm_inter_token_latency_seconds", "variant", ""), "ITL {{variant}}")]),
        ("Engine queue time p95", "s", [
            (p95("ray_vllm_request_queue_time_seconds", "variant", ""), "{{variant}}")]),
        ("Prefix cache hit rate", "percentunit", [
            # vLLM creates the hits series at the first hit: until then the rate is 0.
            ("sum by (variant) (rate(ray_vllm_prefix_cache_hits_total[5m]) or "
             "rate(ray_vllm_prefix_cache_queries_total[5m]) * 0) / sum by (variant) "
             "(rate(ray_vllm_prefix_cache_queries_total[5m]))", "{{variant}}")]),
        ("Finished requests by reason", "reqps", [
            ("sum by (variant, finished_reason) (rate(ray_vllm_request_success_total[5m]))",
             "{{variant}} {{finished_reason}}")]),
    ]),
    (SCALE_TO_ZERO_ROW, [
        ("Variant state (1: warm, 0.5: starting, 0: zero replicas)", "short", [
            ('max by (variant) (ray_mesh_variant_state{state="warm"}) + 0.5 * max by (variant) '
             '(ray_mesh_variant_state{state="starting"})', "{{variant}}")]),
        ("Cold starts and requests held for them", "short", [
            ("sum by (variant, outcome) (increase(ray_mesh_cold_starts_total[1h]))",
             "cold starts {{variant}} {{outcome}}"),
            ("sum by (variant, outcome) (increase(ray_mesh_cold_start_held_requests_total[1h]))",
             "held {{variant}} {{outcome}}")]),
        ("Cold start duration and hold time p95", "s", [
            ("histogram_quantile(0.95, sum by (le, variant) "
             "(rate(ray_mesh_cold_start_seconds_bucket[1h])))", "start {{variant}}"),
            ("histogram_quantile(0.95, sum by (le, variant) "
             "(rate(ray_mesh_cold_start_wait_seconds_bucket[1h])))", "held {{variant}}")]),
        ("Resident budget: evictions (serve_app/variants/resident_budget.py)", "short", [
            ("sum by (variant, outcome) (increase(ray_mesh_resident_evictions_total[1h]))",
             "evicted {{variant}} {{outcome}}")]),
    ]),
    ("Replicas of a variant (the affinity router, serve_app/replica_routing/router.py)", [
        ("Replica routing decisions", "reqps", [
            ("sum by (variant, decision) (rate(ray_mesh_replica_routing_decisions_total[5m]))",
             "{{variant}} {{decision}}")]),
        ("Prefix cache hit rate per replica", "percentunit", [
            ("sum by (variant, ReplicaId) (rate(ray_vllm_prefix_cache_hits_total[5m]) or "
             "rate(ray_vllm_prefix_cache_queries_total[5m]) * 0) / sum by (variant, ReplicaId) "
             "(rate(ray_vllm_prefix_cache_queries_total[5m]))", "{{variant}} {{ReplicaId}}")]),
        ("Requests finished per replica", "reqps", [
            ("sum by (variant, ReplicaId) (rate(ray_vllm_request_success_total[5m]))",
             "{{variant}} {{ReplicaId}}")]),
    ]),
]

#: Rollout decisions as annotations on every time series.
DECISIONS = {
    "datasource": DS, "enable": True, "iconColor": "orange", "name": "rollout decisions",
    "expr": "changes(ray_mesh_rollout_decisions_total[1m]) > 0",
    "titleFormat": "{{rollout}}: {{decision}}", "useValueForTime": False, "step": "15s",
}


def queries(rows: set[str] | None = None, *, but: set[str] = frozenset()
            ) -> list[tuple[str, str]]:
    """``("panel title: legend", PromQL)`` of every target of every panel (of ``rows``,
    else of every row not in ``but``), with ``$route`` set to match every route."""
    return [(f"{title}: {legend}", expr.replace("$route", ".*")) for row, panels in PANELS
            if (row in rows if rows is not None else row not in but)
            for title, _, targets in panels for expr, legend in targets]


def build() -> Dashboard:
    panels, y, ids = [], 0, iter(range(1, 1000))
    for row, row_panels in PANELS:
        panels.append(RowPanel(title=row, gridPos=GridPos(h=1, w=24, x=0, y=y), id=next(ids)))
        y += 1
        for i, (title, unit, targets) in enumerate(row_panels):
            panels.append(TimeSeries(
                title=title, dataSource=DS, unit=unit, id=next(ids),
                gridPos=GridPos(h=8, w=8, x=(i % 3) * 8, y=y + (i // 3) * 8),
                targets=[Target(expr=e, legendFormat=legend, refId=chr(ord("A") + j))
                         for j, (e, legend) in enumerate(targets)]))
        y += ((len(row_panels) + 2) // 3) * 8
    return Dashboard(
        title="Model mesh", uid="model-mesh", description="Per route and variant: traffic, "
        "errors, latency, rollouts, adapters, tenants, admission and the vLLM engines.",
        tags=["model-mesh", "ray-serve", "vllm"], timezone="utc", refresh="10s",
        panels=panels, annotations=Annotations(list=[DECISIONS]),
        templating=Templating(list=[
            Template(name="DS_PROMETHEUS", label="Prometheus", query="prometheus",
                     type="datasource"),
            Template(name="route", label="route", dataSource=DS, includeAll=True,
                     multi=True, default="All",
                     query="label_values(ray_mesh_requests_total, route)")]),
    ).auto_panel_ids()


def render() -> str:
    return json.dumps(build().to_json_data(), cls=DashboardEncoder, indent=2,
                      sort_keys=True) + "\n"


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--check", action="store_true",
                   help="exit 1 when the committed JSON differs from what this builds")
    text = render()
    if p.parse_args().check:
        if OUT.read_text() != text:
            sys.exit(f"{OUT} is out of date: run {Path(__file__).name}")
        print(f"{OUT}: up to date")
        return
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(queries())} queries)")


if __name__ == "__main__":
    run(main)
