"""Fixtures for integration tests: one real Ray cluster per session, Serve configs deployed
with the real ``serve deploy`` CLI, the official ``openai`` client against the mesh.

The cluster uses its own free ports (GCS, dashboard, Serve HTTP on 127.0.0.1), so a demo mesh
running on the default ports is not disturbed.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from serve_app.release.deploy import deploy, replica_ids, serve_status
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_env import SERVE_ENV
from serve_app.common.serve_configs import load_yaml
from serve_app.tools.servers import free_port

CONFIGS = REPO_ROOT / "serve_configs"


class Mesh:
    """A running Ray cluster with Serve, and helpers to deploy configs onto it."""

    def __init__(self, dashboard: str, http_port: int, workdir: Path):
        self.dashboard = dashboard
        self.http_port = http_port
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.workdir = workdir
        self._n = 0

    def config(self, name: str) -> dict[str, Any]:
        """A config from serve_configs/, with http_options pointed at this cluster's port
        and a proxy on every node."""
        cfg = copy.deepcopy(load_yaml(CONFIGS / name))
        cfg["http_options"] = {**cfg.get("http_options", {}), "host": "127.0.0.1",
                               "port": self.http_port}
        # A proxy per node: the head's alone until test_multi_node adds a node. Serve reads
        # this only when it starts, so every config of the session says the same.
        cfg["proxy_location"] = "EveryNode"
        return cfg

    def deploy_shipped(self, name: str) -> dict[str, Any]:
        """Deploy serve_configs/<name> (on this cluster's port); return the config deployed."""
        cfg = self.config(name)
        self.deploy(cfg)
        return cfg

    def write(self, cfg: dict[str, Any]) -> Path:
        self._n += 1
        path = self.workdir / f"config-{self._n}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def deploy(self, cfg: dict[str, Any], **kw) -> Path:
        """Write ``cfg`` to a file and apply it with the ``serve deploy`` CLI; wait for RUNNING."""
        path = self.write(cfg)
        deploy(path, self.dashboard, **kw)
        return path

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120)

    def replica_ids(self, app: str, deployment: str) -> set[str]:
        return replica_ids(self.dashboard, app, deployment)

    def all_replica_ids(self) -> dict[str, set[str]]:
        """Replica ids of every application's deployments (restart checks)."""
        status = serve_status(self.dashboard)["applications"]
        return {f"{app}/{dep}": replica_ids(self.dashboard, app, dep)
                for app, a in status.items() for dep in a.get("deployments", {})}


@pytest.fixture(scope="session")
def mesh(tmp_path_factory) -> Mesh:
    """A local Ray cluster (started in this process, with the dashboard for ``serve deploy``)."""
    import ray
    from ray import serve

    # Loopback-only test cluster: no token auth, so the serve CLI and the REST status calls
    # need no token (production clusters keep Ray's token auth; see README).
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.update(SERVE_ENV)  # the cluster runs with the mesh's Serve settings
    dash_port, http_port, metrics_port = free_port(), free_port(), free_port()
    # address="local": a new cluster even when `ray start` left /tmp/ray/ray_current_cluster.
    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=dash_port, configure_logging=False, log_to_driver=False,
             _metrics_export_port=metrics_port)
    m = Mesh(f"http://127.0.0.1:{dash_port}", http_port, tmp_path_factory.mktemp("configs"))
    m.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield m
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def local_mesh(mesh: Mesh) -> Mesh:
    """serve_configs/local.yaml deployed with the serve CLI (one vLLM variant, route smollm)."""
    mesh.deploy_shipped("local.yaml")
    return mesh


#: Integration modules in the order that restarts the fewest engines: each deploys its own
#: config onto the shared cluster, and a variant whose `args` stay the same keeps its replica.
MODULE_ORDER = ["test_replica_routing",  # first: the router's handle is made with its config
                "test_serving", "test_tenants", "test_tenant_token_budgets", "test_overload",
                "test_base_swap",  # after every module on local.yaml's smollm-v1: it changes it
                "test_canary", "test_scale_to_zero",  # after canary: the same two variants
                "test_rollouts", "test_traffic_safety", "test_shadow_traffic",
                "test_observability", "test_multi_node"]  # last: it kills a node


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.module.__name__.rpartition(".")[2]
        return MODULE_ORDER.index(name) + 1 if name in MODULE_ORDER else 0  # unit tests first
    items.sort(key=rank)  # stable: the order within a module is kept
