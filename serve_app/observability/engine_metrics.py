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

**The same histogram buckets in every variant.** vLLM sizes the buckets of its token-count
histograms (``vllm:request_prompt_tokens``, ``request_generation_tokens``,
``request_max_num_generation_tokens``, ``request_params_max_tokens``,
``request_prefill_kv_computed_tokens``: the ``request_tokens`` family of
``vllm.v1.metrics.buckets``) from the engine's ``max_model_len``, and any family from the
engine arg ``custom_histogram_buckets``. Ray's metrics agent keeps the first bucket list it
sees per metric name and drops the data points of every process whose list differs ("reported
with 11 buckets but 12 were expected"), so a canary with another ``max_model_len`` would lose
those series. :class:`VariantStatLogger` therefore builds every family's buckets for one
mesh-wide ceiling, :data:`MESH_MAX_MODEL_LEN`, whatever the engine args
(:func:`mesh_histogram_buckets`).
"""

from __future__ import annotations

import copy
import functools

from vllm.v1.metrics.buckets import BUCKET_FAMILY_KEYS, histogram_buckets
from vllm.v1.metrics.ray_wrappers import (RayCounterWrapper, RayGaugeWrapper,
                                          RayHistogramWrapper, RayPrometheusStatLogger,
                                          _get_replica_id)

from serve_app.common.logs import get_logger

logger = get_logger(__name__)

#: The longest context (tokens) the token-count histograms are bucketed for, in every
#: variant: 1-2-5 buckets up to 100,000. A count above the last bucket still counts (+Inf).
MESH_MAX_MODEL_LEN = 131_072


@functools.cache
def _variant() -> str:
    """This process's variant (its Serve application; "" outside a replica). Read once: a
    replica's process serves one variant for its life, and the stat logger tags every value
    of every engine step with it."""
    from ray import serve

    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 -- outside a Serve replica (tests, scripts)
        return ""


@functools.cache
def _replica_id() -> str:
    """This process's Serve replica id ("" outside a replica), read once (see :func:`_variant`)."""
    return _get_replica_id() or ""


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
        return {**tags, "variant": _variant(), "ReplicaId": _replica_id()}


class _Gauge(_VariantTagged, RayGaugeWrapper):
    pass


class _Counter(_VariantTagged, RayCounterWrapper):
    pass


class _Histogram(_VariantTagged, RayHistogramWrapper):
    pass


def mesh_histogram_buckets() -> dict[str, list[float]]:
    """Bucket bounds of each vLLM histogram family (``vllm.v1.metrics.buckets``), the same in
    every variant: vLLM's defaults, with the token counts bucketed up to
    :data:`MESH_MAX_MODEL_LEN` tokens (the timing families are in seconds)."""
    return {family: histogram_buckets(family, max_model_len=MESH_MAX_MODEL_LEN)
            for family in sorted(BUCKET_FAMILY_KEYS)}


def _with_mesh_buckets(vllm_config):
    """A shallow copy of ``vllm_config`` whose ``custom_histogram_buckets`` are
    :func:`mesh_histogram_buckets` (the engine's own config is left as it is)."""
    observability = vllm_config.observability_config
    if observability.custom_histogram_buckets:
        logger.warning("engine arg custom_histogram_buckets %s is ignored: every variant's "
                       "histograms use the mesh's buckets, or Ray would drop some variants' "
                       "series", sorted(observability.custom_histogram_buckets))
    config = copy.copy(vllm_config)
    config.observability_config = copy.copy(observability)
    config.observability_config.custom_histogram_buckets = mesh_histogram_buckets()
    return config


class VariantStatLogger(RayPrometheusStatLogger):
    """vLLM's Ray stat logger with a ``variant`` label on every series, and the same
    histogram buckets in every variant (:func:`mesh_histogram_buckets`); pass the class as
    ``AsyncLLM(..., stat_loggers=[VariantStatLogger])``."""

    _gauge_cls = _Gauge
    _counter_cls = _Counter
    _histogram_cls = _Histogram

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None) -> None:
        super().__init__(_with_mesh_buckets(vllm_config), engine_indexes)
