"""Unit test of the engine stat logger's histogram buckets: variants with different engine
args (max_model_len, custom_histogram_buckets) get the same bucket list for every vLLM
histogram, so Ray's metrics agent keeps every variant's series.

Builds real ``VllmConfig``s with the replica's own ``engine_config`` (no engine starts; ~10 s
the first time in a process) and real Ray metric objects (no Ray cluster)."""

from __future__ import annotations

import pytest

from serve_app.common.config import VariantArgs
from serve_app.common.paths import models_dir

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.skipif(not (models_dir() / MODEL).is_dir(),
                                reason="the embedded model is not prepared (scripts/setup.sh)")


def histogram_buckets_of(**engine_args) -> dict[str, list[float]]:
    """Metric name -> bucket bounds of every histogram a VariantStatLogger creates for a
    variant with these engine args."""
    from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

    from serve_app.observability.engine_metrics import VariantStatLogger
    from serve_app.server.engine import engine_config

    _, _, vllm_config = engine_config(VariantArgs(
        model=MODEL, served_model_name="smollm",
        engine_args={"dtype": "float32", "enforce_eager": True, **engine_args}))
    assert vllm_config.model_config.max_model_len == engine_args["max_model_len"]
    stat_logger = VariantStatLogger(vllm_config, [0])
    found: dict[str, list[float]] = {}

    def walk(o) -> None:
        if isinstance(o, RayHistogramWrapper):
            found[o.metric._name] = list(o.metric.boundaries)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    for value in vars(stat_logger).values():
        walk(value)
    return found


def test_every_variant_gets_the_same_histogram_buckets():
    short = histogram_buckets_of(max_model_len=1024)
    long = histogram_buckets_of(max_model_len=2048,
                                custom_histogram_buckets={"time_to_first_token": [0.5, 1.0]})
    assert "vllm_request_prompt_tokens" in short and "vllm_request_generation_tokens" in short
    assert short == long
    # The token counts are bucketed past both engines' max_model_len (vLLM alone would stop
    # at 1000 and 2000), the timings keep vLLM's defaults.
    assert short["vllm_request_prompt_tokens"][-1] == 100_000
    assert short["vllm_request_params_max_tokens"] == short["vllm_request_prompt_tokens"]
    assert short["vllm_time_to_first_token_seconds"][:2] == [0.001, 0.005]


def test_the_engine_config_itself_is_left_alone():
    from serve_app.observability.engine_metrics import _with_mesh_buckets
    from serve_app.server.engine import engine_config

    _, _, vllm_config = engine_config(VariantArgs(
        model=MODEL, served_model_name="smollm",
        engine_args={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}))
    copied = _with_mesh_buckets(vllm_config)
    assert vllm_config.observability_config.custom_histogram_buckets is None
    assert copied.observability_config.custom_histogram_buckets["request_tokens"][-1] == 100_000
    assert copied.model_config is vllm_config.model_config
