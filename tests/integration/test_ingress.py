"""What the ingress (Serve's HTTP proxy, or Ray's HAProxy: ``MESH_INGRESS``,
serve_app/common/serve_env.py) must keep, whichever runs the session's cluster: one address
(``http_options``' port) that answers Serve's health checks and the router's ``/health``, an
over-limit body refused with 413 as soon as its headers say so, and every HTTP port of the
mesh on ``http_options.host`` (127.0.0.1 here). Streaming, and a client disconnect aborting
the engine request, are checked through the same address by test_tenant_token_budgets,
test_real_engine and every load of the suite.
"""

from __future__ import annotations

import json
import socket

import httpx
import psutil
import pytest

from serve_app.common.serve_env import SERVE_ENV
from serve_app.release.deploy import serve_status
from serve_app.request.body import MAX_REQUEST_BYTES

pytestmark = pytest.mark.integration

OPS = {"authorization": "Bearer sk-mesh-ops-demo"}
HAPROXY = SERVE_ENV.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"


@pytest.fixture(scope="module")
def ingress(mesh):
    mesh.deploy_shipped("tenants.yaml")
    return mesh


def test_one_address_answers_serves_health_checks_and_the_routers(ingress):
    with ingress.http() as http:
        healthz = http.get("/-/healthz")
        assert (healthz.status_code, healthz.text) == (200, "success")
        routes = http.get("/-/routes")
        assert routes.status_code == 200 and routes.json() == {"/": "mesh"}
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"


def test_an_over_limit_body_is_refused_from_its_headers(ingress):
    """The router answers 413 from ``Content-Length`` alone: the client has sent its headers
    and 1 KiB of a body over the limit, and gets the OpenAI error before sending the rest."""
    size = MAX_REQUEST_BYTES + 1
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: {OPS['authorization']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", ingress.http_port), timeout=30) as s:
        s.sendall(head + b" " * 1024)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split(b" ")[1] == b"413", answer[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large" and str(size) in error["message"]
    # and the whole body, sent by the client the SDKs use
    body = b'{"model": "smollm", "messages": [{"role": "user", "content": "' + (
        b"a" * MAX_REQUEST_BYTES) + b'"}]}'
    with ingress.http() as http:
        r = http.post("/v1/chat/completions", content=body,
                      headers={**OPS, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def _listening(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN]


def test_every_http_port_of_the_mesh_is_on_the_configs_host(ingress):
    """Serve's HTTP servers bind ``http_options.host``: the ingress on the config's port,
    and, with HAProxy, each replica's own port (Serve's direct-ingress range), which HAProxy
    forwards to. (gRPC between Ray's workers, and HAProxy's stats and Prometheus ports, are
    Ray's own, on every interface: docs/operating.md, "Ports".)"""
    from ray.serve._private.constants import (RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT as HI,
                                              RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT as LO)

    apps = serve_status(ingress.dashboard)["applications"]
    pids = {name: [r["pid"] for r in dep.get("replicas", []) if r.get("state") == "RUNNING"]
            for app in apps.values() for name, dep in app["deployments"].items()}
    assert pids["MeshRouter"] and pids["LLMReplica"]
    ports = {pid: [a for a in _listening(pid) if LO <= a[1] <= HI]
             for pids_of in pids.values() for pid in pids_of}
    entry = {a for p in psutil.process_iter() for a in _safe_listening(p)
             if a[1] == ingress.http_port}
    assert entry == {("127.0.0.1", ingress.http_port)}
    if HAPROXY:  # the router takes HTTP on its own port, behind HAProxy
        assert all(ports[pid] for pid in pids["MeshRouter"]), ports
        assert {ip for addrs in ports.values() for ip, _ in addrs} == {"127.0.0.1"}, ports
    else:  # the proxy relays over Ray: no replica takes HTTP itself
        assert not any(ports.values()), ports


def _safe_listening(p: psutil.Process) -> list[tuple[str, int]]:
    try:
        return _listening(p.pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
