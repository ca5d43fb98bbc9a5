"""``VariantIngress``: the ingress deployment of every variant application.

A variant application is ``VariantIngress`` bound to its ``LLMReplica`` (as Ray Serve LLM
binds its ``LLMServer`` under an ``OpenAiIngress``). The router never sends HTTP to a variant:
it calls the ``LLMReplica`` deployment by name through a handle
(``serve.get_deployment_handle("LLMReplica", app_name=...)``), so this deployment serves
nothing and costs one small actor with no CPU reserved.

Why it exists: under Ray's high-throughput ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``, the
mesh's default, :mod:`serve_app.common.serve_env`) HAProxy balances HTTP to each
application's ingress replicas itself, so Serve refuses a custom
``request_router_config.request_router_class`` on an ingress deployment
(``ray/serve/_private/build_app.py``, ``CUSTOM_INGRESS_REQUEST_ROUTER_UNSUPPORTED_ERROR``,
Ray 2.60). With ``LLMReplica`` behind an ingress of its own, the mesh's cache-aware replica
router (:mod:`serve_app.replica_routing`) runs under either ingress. docs/architecture.md
says why this shape was chosen over Ray's ingress request router.
"""

from __future__ import annotations

from typing import Any

from ray.serve.handle import DeploymentHandle

#: The deployment's name in every variant application.
INGRESS_DEPLOYMENT = "VariantIngress"

#: Its Serve options: one replica, no CPU reserved (it runs no request), a quick stop.
INGRESS_OPTIONS: dict[str, Any] = dict(
    name=INGRESS_DEPLOYMENT,
    num_replicas=1,
    max_ongoing_requests=8,
    graceful_shutdown_timeout_s=5,
    ray_actor_options={"num_cpus": 0},
)


class VariantIngress:
    """The ingress of a variant application; holds its ``LLMReplica``'s handle.

    Args:
        replica: the handle Serve injects for the bound ``LLMReplica``.
    """

    def __init__(self, replica: DeploymentHandle) -> None:
        self.replica = replica

    async def __call__(self, *_: Any) -> dict[str, str]:
        """Answers a stray call: variants are reached through the mesh's router."""
        return {"error": "a variant application is called through the mesh's router "
                         "(application 'mesh'), not directly"}
