"""vLLM's engine metrics through Ray's metrics, labelled with the mesh's variant.

Ray Serve LLM passes vLLM's own ``RayPrometheusStatLogger`` (``vllm.v1.metrics.ray_wrappers``)
to ``AsyncLLM``: every ``vllm:*`` series then reaches Ray's metrics export port, named as Ray
names custom metrics (``vllm:num_requests_running`` -> ``ray_vllm_num_requests_running``),
labelled ``model_name``, ``engine`` and ``ReplicaId``. Every variant of a route serves the same
``model_name`` (the route), so this logger adds one label, ``variant`` (the Serve application),
to every series: a canary's engine can be put beside its stable arm's.

Series (vLLM's names; see vLLM's "Production Metrics" docs): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries`` /
``vllm:prefix_cache_hits``, ``vllm:request_success`` (``finished_reason``),
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
``vllm:prompt_tokens`` / ``vllm:generation_tokens``, and the rest vLLM records.
"""

from __future__ import annotations

from vllm.v1.metrics.ray_wrappers import (RayCounterWrapper, RayGaugeWrapper,
                                          RayHistogramWrapper, RayPrometheusStatLogger,
                                          _get_replica_id)


def _variant() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 -- outside a Serve replica (tests, scripts)
        return ""


class _VariantTagged:
    """Mixin for vLLM's Ray metric wrappers: one more tag key, ``variant``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._tags = {**self._tags, "variant": _variant()}

    @staticmethod
    def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
        return (*(labelnames or ()), "variant", "ReplicaId")

    def _build_tags(self, *labels, **labelskwargs) -> dict[str, str]:
        if labels:
            keys = self.metric._tag_keys[:-2]  # without variant and ReplicaId
            if len(labels) != len(keys):
                raise ValueError(f"Number of labels must match the number of tag keys. "
                                 f"Expected {len(keys)}, got {len(labels)}")
            labelskwargs.update(zip(keys, labels))
        tags = {k: v if isinstance(v, str) else str(v) for k, v in labelskwargs.items()}
        return {**tags, "variant": _variant(), "ReplicaId": _get_replica_id() or ""}


class _Gauge(_VariantTagged, RayGaugeWrapper):
    pass


class _Counter(_VariantTagged, RayCounterWrapper):
    pass


class _Histogram(_VariantTagged, RayHistogramWrapper):
    pass


class VariantStatLogger(RayPrometheusStatLogger):
    """vLLM's Ray stat logger with a ``variant`` label on every series; pass the class as
    ``AsyncLLM(..., stat_loggers=[VariantStatLogger])``."""

    _gauge_cls = _Gauge
    _counter_cls = _Counter
    _histogram_cls = _Histogram
