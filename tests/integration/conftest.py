"""Fixtures of the integration tests: one real Ray cluster per session (:class:`Mesh`), Serve
configs deployed with the real ``serve deploy`` CLI, the official ``openai`` client against
the mesh. Every test collected here is marked ``integration`` (so ``-m "not integration"``
runs the unit tests alone).

The cluster uses its own free ports (GCS, dashboard, Serve HTTP on 127.0.0.1), so a demo mesh
running on the default ports is not disturbed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.servers import free_port, side_cluster_ports
from serve_app.common.serve_env import SERVE_ENV
from tests.support.mesh import TEST_ENGINE, Mesh

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def mesh(tmp_path_factory) -> Mesh:
    """A local Ray cluster (started in this process, with the dashboard for ``serve deploy``)."""
    import ray
    from ray import serve

    # Loopback-only test cluster: no token auth, so the serve CLI and the REST status calls
    # need no token (production clusters keep Ray's token auth; see README).
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.update(SERVE_ENV)  # the cluster runs with the mesh's Serve settings
    os.environ.update(side_cluster_ports())  # beside a demo mesh's HAProxy, if any
    # The mesh's processes at the test clients' niceness: Ray's default (15) would let a
    # flood's own client, in this process, take the cores from the proxy and router it
    # measures (in production nothing at nice 0 competes with the mesh on its nodes).
    os.environ["RAY_worker_niceness"] = "0"
    # vLLM's engine checks at build time start from nothing, here as in CI's fresh machine:
    # a session's own record of accepted args (serve_app/server/engine_checks.py), so the
    # suite's time does not depend on what earlier runs left in ~/.cache.
    os.environ["MESH_CACHE_DIR"] = str(tmp_path_factory.mktemp("mesh-cache"))
    dash_port, http_port, metrics_port = free_port(), free_port(), free_port()
    # address="local": a new cluster even when `ray start` left /tmp/ray/ray_current_cluster.
    # Metrics exported every second (Ray's minimum; 10 s by default), so tests that read
    # them wait on the value, not on a fixed sleep.
    context = ray.init(address="local", num_cpus=4, include_dashboard=True,
                       dashboard_host="127.0.0.1", dashboard_port=dash_port,
                       configure_logging=False, log_to_driver=False,
                       _metrics_export_port=metrics_port,
                       _system_config={"metrics_report_interval_ms": 1000})
    m = Mesh(f"http://127.0.0.1:{dash_port}", http_port, tmp_path_factory.mktemp("configs"))
    m.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    # This cluster's Serve logs (not /tmp/ray/session_latest, which may name another's)
    m.serve_logs = Path(context.address_info["session_dir"]) / "logs" / "serve"
    yield m
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def module_engine(request) -> str:
    """The engine this module's variants run on (sets :attr:`Mesh.engine`)."""
    if request.node.get_closest_marker("real_engine"):
        Mesh.engine = "vllm"
    elif request.node.get_closest_marker("sim_only"):
        Mesh.engine = "sim"
    else:
        Mesh.engine = TEST_ENGINE
    return Mesh.engine


@pytest.fixture(scope="module")
def local_mesh(mesh: Mesh) -> Mesh:
    """serve_configs/local.yaml deployed with the serve CLI (one vLLM variant, route smollm)."""
    mesh.deploy_shipped("local.yaml")
    return mesh
