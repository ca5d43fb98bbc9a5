"""The integration tests' mesh: a running Ray cluster with Serve, deploying serve_configs/ with
the real ``serve deploy`` CLI on the tier's engine, and the official ``openai`` client against
it. The session fixture that starts it is in ``tests/integration/conftest.py``."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml, on_sim_engine
from serve_app.release.deploy import deploy, replica_ids, running_in, serve_status

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

    def deploy(self, cfg: dict[str, Any], *, in_place: bool = False, **kw) -> Path:
        """Write ``cfg`` to a file and apply it with the ``serve deploy`` CLI; wait for RUNNING.
        Prints every deployment whose replicas the deploy replaced (``[restart]``): each is
        an engine start, the suite's main cost.

        Args:
            in_place: the change is one the mesh applies in place (docs/in-place-changes.md):
                fail (AssertionError) when a deployment's replica that ran before it was
                replaced (gone, and a new one started: an actor, and with it an engine,
                started anew); scaling its replicas up or down is no replacement."""
        before = self.all_replica_ids()
        path = self.write(cfg)
        t0 = time.monotonic()
        deploy(path, self.dashboard, **kw)
        DEPLOY_SECONDS.append(time.monotonic() - t0)
        after = self.all_replica_ids()
        # replaced: a replica of it is gone and another came (a scale-down only removes one,
        # a scale-up only adds)
        replaced = {name: sorted(ids - after[name]) for name, ids in before.items()
                    if name in after and ids - after[name] and after[name] - ids}
        for name, ids in after.items():
            if name.endswith("/VariantIngress"):  # no engine: not the suite's cost
                continue
            if before.get(name) and ids and not ids & before[name]:
                RESTARTS.append(f"{name}: every replica replaced by {path.name} "
                                f"({os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]})")
        assert not (in_place and replaced), (
            f"an in-place change ({path.name}) replaced replicas: {replaced}")
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
        status = serve_status(self.dashboard)["applications"]  # one document: one call
        return {f"{app}/{name}": {r["replica_id"] for r in running_in(dep)}
                for app, a in status.items() for name, dep in a.get("deployments", {}).items()}


#: Deployments whose replicas a test's deploy replaced (an engine start each).
RESTARTS: list[str] = []
#: Seconds each :meth:`Mesh.deploy` took, ``serve deploy`` until RUNNING (the run's summary).
DEPLOY_SECONDS: list[float] = []
