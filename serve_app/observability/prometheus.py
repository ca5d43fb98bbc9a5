"""Prometheus's HTTP API, as ``meshctl rollout-report`` reads it: instant and range queries.

The Prometheus that scrapes the mesh is the operator's (``deploy/prometheus/prometheus.yml`` is
its scrape config); ``scripts/observability.sh`` runs one on this host for the demo and the
tests (:mod:`bench.local_prometheus`, outside the product).
"""

from __future__ import annotations

from typing import Any

import httpx


class PrometheusError(RuntimeError):
    """Prometheus is not installed, did not start, or refused a query."""


def query(url: str, promql: str, at: float | None = None) -> list[dict[str, Any]]:
    """An instant query through Prometheus's HTTP API (``/api/v1/query``): its result list.

    Raises:
        PrometheusError: the query was refused (bad PromQL), with Prometheus's message.
    """
    params = {"query": promql, **({"time": at} if at else {})}
    body = httpx.get(f"{url}/api/v1/query", params=params, timeout=30).json()
    if body.get("status") != "success":
        raise PrometheusError(f"{promql}: {body.get('error')}")
    return body["data"]["result"]


def query_range(url: str, promql: str, start: float, end: float, step_s: float
                ) -> list[dict[str, Any]]:
    """A range query (``/api/v1/query_range``): one ``{"metric", "values"}`` per series.

    Raises:
        PrometheusError: the query was refused.
    """
    body = httpx.get(f"{url}/api/v1/query_range", timeout=30, params={
        "query": promql, "start": start, "end": end, "step": step_s}).json()
    if body.get("status") != "success":
        raise PrometheusError(f"{promql}: {body.get('error')}")
    return body["data"]["result"]
