"""A variant application's shape: ``VariantIngress`` is its ingress deployment and
``LLMReplica`` a deployment bound under it, so Ray Serve's rule against a custom request
router on an ingress deployment under HAProxy never applies to ``LLMReplica``."""

from __future__ import annotations

from serve_app.common.serve_configs import REPLICA_DEPLOYMENT
from serve_app.replica import build_app
from serve_app.variant_ingress import INGRESS_DEPLOYMENT


def test_a_variant_application_has_llmreplica_behind_its_own_ingress():
    from ray.serve._private.build_app import build_app as build_serve_app

    args = {"model": "smollm2-135m-instruct", "served_model_name": "smollm", "engine": "sim"}
    built = build_serve_app(build_app(args), name="smollm-v1")
    assert built.ingress_deployment_name == INGRESS_DEPLOYMENT
    assert sorted(d.name for d in built.deployments) == sorted(
        [INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT])
    ingress = next(d for d in built.deployments if d.name == INGRESS_DEPLOYMENT)
    assert ingress.ray_actor_options.get("num_cpus") == 0  # it runs no request
