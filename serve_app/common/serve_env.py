"""Ray Serve settings the mesh's cluster runs with (environment of ``ray start``).

``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` is Ray Serve's own bundle for high-throughput serving:
user code and the handle router on each replica's main event loop (no thread hop per
message), gRPC between the proxy and the replicas and between replicas, buffered request
logs, a frozen garbage collector after start-up. It cuts the router's CPU per
streamed token by about a third (docs/benchmarks.md). Its direct-ingress part (each
ingress replica listening on its own port) stays off: clients keep one address, the proxy.
Its log buffer (1000 records, flushed only when full or on an error) is set back to 1, so
the access log and warnings reach the replicas' log files as they happen.

These are read when Ray's processes start, so they go in the environment of ``ray start``
(``scripts/demo.sh``, the test cluster in ``tests/integration/conftest.py``, a KubeRay pod spec).

    eval "$(python -m serve_app.common.serve_env)"   # export them in a shell
"""

from __future__ import annotations

SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}

if __name__ == "__main__":
    print("\n".join(f"export {k}={v}" for k, v in SERVE_ENV.items()))
