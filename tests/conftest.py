"""Fixtures for integration tests: one real Ray cluster per session, Serve configs deployed
with the real ``serve deploy`` CLI, the official ``openai`` client against the mesh.

The cluster uses its own free ports (GCS, dashboard, Serve HTTP on 127.0.0.1), so a demo mesh
running on the default ports is not disturbed.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from serve_app.release.deploy import deploy, replica_ids, serve_status
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_env import SERVE_ENV
from serve_app.common.serve_configs import load_yaml, on_sim_engine
from bench.servers import free_port

CONFIGS = REPO_ROOT / "serve_configs"

#: The engine integration tests run on: ``sim`` (the default tier) or ``vllm``
#: (``./scripts/test.sh --all``). Modules marked ``real_engine`` always run on vLLM, and those
#: marked ``sim_only`` (goals that hold only where time is exact) always on the sim.
TEST_ENGINE = os.environ.get("MESH_TEST_ENGINE", "sim")

#: ``args.sim`` of every variant the sim tier deploys: this host's fitted profile at a quarter
#: of its durations (``time_scale``: the fitted engine runs float32 with LoRA on, ~4x slower
#: than vLLM in bf16 on this host, STACK.md's 30.7 tokens/s at c=1; a quarter keeps the
#: suite near half an hour here, with the same order of events), an engine that starts at
#: once (a test that needs a slow start sets ``start_s``), and a reconfigure that takes
#: 0.5 s, so that every in-place change of the suite passes through a window in which Serve
#: shows the replica UPDATING (issue 31), and no module needs other args.
TEST_SIM_ARGS = {"profile": "cpu-smollm2", "time_scale": 0.25, "start_s": 0,
                 "reconfigure_s": 0.5}


def on_engine(cfg: dict[str, Any], engine: str, **sim: Any) -> dict[str, Any]:
    """``cfg`` with every variant application on ``engine`` (``sim``: with
    :data:`TEST_SIM_ARGS` updated by ``sim``; ``vllm``: as shipped)."""
    return on_sim_engine(cfg, TEST_SIM_ARGS, **sim) if engine == "sim" else copy.deepcopy(cfg)


class Mesh:
    """A running Ray cluster with Serve, and helpers to deploy configs onto it.

    ``engine`` is the engine the current module's configs run on (:data:`TEST_ENGINE`,
    or its ``real_engine`` / ``sim_only`` marker)."""

    engine = TEST_ENGINE

    def __init__(self, dashboard: str, http_port: int, workdir: Path):
        self.dashboard = dashboard
        self.http_port = http_port
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.workdir = workdir
        self._n = 0

    def config(self, name: str) -> dict[str, Any]:
        """A config from serve_configs/, with http_options pointed at this cluster's port,
        a proxy on every node, and its variants on this module's engine (:attr:`engine`)."""
        cfg = on_engine(load_yaml(CONFIGS / name), self.engine)
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
        """Write ``cfg`` to a file and apply it with the ``serve deploy`` CLI; wait for RUNNING.
        Prints every deployment whose replicas the deploy replaced (``[restart]``): each is
        an engine start, the suite's main cost."""
        before = self.all_replica_ids()
        path = self.write(cfg)
        deploy(path, self.dashboard, **kw)
        after = self.all_replica_ids()
        for name, ids in after.items():
            if before.get(name) and ids and not ids & before[name]:
                RESTARTS.append(f"{name}: every replica replaced by {path.name} "
                                f"({os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]})")
        return path

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120)

    def metrics_text(self) -> str:
        """The cluster's Prometheus exposition (Ray's metrics export port). Generous timeout:
        the page grows to megabytes over the suite (every config's label values) and Ray's
        agent writes it on one core."""
        return httpx.get(self.metrics_url, timeout=60).text

    def replica_ids(self, app: str, deployment: str) -> set[str]:
        return replica_ids(self.dashboard, app, deployment)

    def router_access(self, prefix: str, expected: int, where=lambda entry: True,
                      timeout_s: float = 15) -> list[dict[str, Any]]:
        """The router replicas' access-log entries (request_id, tenant, status, ttft_ms,
        queue_ms, latency_ms, error...) of the requests whose ``x-request-id`` starts with
        ``prefix + "-"`` and that ``where`` accepts; waits until ``expected`` are written
        (each is written as its request ends)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = []
            for path in self.serve_logs.glob("replica_mesh_MeshRouter_*.log"):
                for line in open(path):
                    if f'"request_id": "{prefix}-' in line and " access {" in line:
                        entry = json.loads(line[line.index(" access {") + 8:])
                        found += [entry] if where(entry) else []
            if len(found) >= expected or time.monotonic() > deadline:
                assert len(found) == expected, (len(found), expected)
                return found
            time.sleep(0.5)

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


#: Integration modules in the order that restarts the fewest engines: each deploys its own
#: config onto the shared cluster, and a variant whose code version (args, runtime_env,
#: request_router_config, autoscaling policy) stays the same keeps its replica. Each deploy
#: that replaced replicas is listed at the end of the run. No module restores a config when
#: it ends: the next one deploys its own.
MODULE_ORDER = ["test_replica_routing",  # first: the router's handle is made with its config
                "test_tenants", "test_tenant_token_budgets", "test_fairness", "test_overload",
                "test_in_place", "test_canary", "test_rollouts", "test_traffic_safety",
                "test_shadow_traffic",
                "test_observability",  # some panels read the counts of the modules before
                "test_scale_to_zero",  # changes smollm-v2's autoscaling (a restart)
                "test_base_swap",  # changes smollm-v1's args and swaps its base model
                "test_real_engine",  # real vLLM engines: after every module on the sim
                "test_multi_node"]  # last: it kills a node


#: Run the integration tests marked ``slow`` in this tier too (``--all`` always does).
RUN_SLOW = TEST_ENGINE == "vllm" or os.environ.get("MESH_TEST_SLOW") == "1"
_left_to_all: list[str] = []


def pytest_collection_modifyitems(config, items):
    if not RUN_SLOW:  # the default tier leaves them to --all (named in the summary)
        slow = [i for i in items if i.get_closest_marker("slow")]
        _left_to_all.extend(i.nodeid for i in slow)
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [i for i in items if not i.get_closest_marker("slow")]

    def rank(item) -> int:
        name = item.module.__name__.rpartition(".")[2]
        return MODULE_ORDER.index(name) + 1 if name in MODULE_ORDER else 0  # unit tests first
    items.sort(key=rank)  # stable: the order within a module is kept


# -- per-module durations, and the time budget of the default tier ------------------------------

#: The default tier's goal: 25 minutes, set-up included (issue 26). Not met on 2-core hosts
#: yet (the same tests took 1,191-2,382 s, host to host and day to day): the summary says
#: by how much on every run.
TEST_GOAL_S = 1500
#: Seconds past which the run fails (``MESH_TEST_BUDGET_S``; 0: none): 60 minutes, two
#: thirds of CI's hard limit, so a regression fails here before CI cuts the run off, and
#: above the slowest host measured (2,382 s in CI), so a slow day is not a failure.
TEST_BUDGET_S = float(os.environ.get("MESH_TEST_BUDGET_S", "3600"))
_module_seconds: dict[str, float] = {}
#: Deployments whose replicas a test's deploy replaced (an engine start each).
RESTARTS: list[str] = []
_session_start = time.monotonic()


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    total = time.monotonic() - _session_start
    tr = terminalreporter
    tr.section("time per test module (setup + call + teardown), s")
    for module, seconds in sorted(_module_seconds.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{seconds:8.1f}  {module}")
    tr.write_line(f"{total:8.1f}  total (engine for integration tests: {TEST_ENGINE}; "
                  f"goal {TEST_GOAL_S} s; fails past {TEST_BUDGET_S:.0f} s)")
    if _left_to_all:
        tr.section(f"integration tests left to ./scripts/test.sh --all (slow): "
                   f"{len(_left_to_all)}")
        for nodeid in _left_to_all:
            tr.write_line(nodeid)
    if RESTARTS:
        tr.section(f"deploys that replaced replicas: {len(RESTARTS)}")
        for line in RESTARTS:
            tr.write_line(line)
    if TEST_GOAL_S < total <= (TEST_BUDGET_S or float("inf")) and not RUN_SLOW:
        tr.write_line(f"over the goal: the tests took {total:.0f} s, {total - TEST_GOAL_S:.0f} s "
                      f"more than the {TEST_GOAL_S} s goal", yellow=True, bold=True)
    if TEST_BUDGET_S and total > TEST_BUDGET_S:
        tr.write_line(f"FAILED: the tests took {total:.0f} s, over the budget of "
                      f"{TEST_BUDGET_S:.0f} s (MESH_TEST_BUDGET_S)", red=True, bold=True)


def pytest_sessionfinish(session, exitstatus):
    if TEST_BUDGET_S and time.monotonic() - _session_start > TEST_BUDGET_S and exitstatus == 0:
        session.exitstatus = 1

