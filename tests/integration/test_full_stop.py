"""The operating guide's full stop on the demo mesh (docs/operating.md, "Stop everything"):
``scripts/demo.sh`` with the tenants config, a limited tenant's request (which creates the
detached tenant counts actor), ``scripts/observability.sh`` in the background, then
``scripts/stop.sh``: afterwards no Ray process, no Prometheus and no listener on the demo's
ports is left, and the observability script has exited.

It runs the demo as a user does, on the default ports, and ``ray stop`` stops every Ray of
this user on the host, so it is skipped when a Ray cluster or a demo port is already in use.
Run it alone:

    .venv/bin/python -m pytest tests/integration/test_full_stop.py -m integration -v

Its variant runs on the tier's engine (``MESH_TEST_ENGINE``: the simulated one by default).
"""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest
import yaml

from tests.support.mesh import TEST_ENGINE, on_engine
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.tenancy.ledger import SHARED_NAME, SHARED_NAMESPACE
from bench import full_stop

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ACME_KEY = "sk-acme-demo"  # tenants.yaml: acme has max_concurrent_requests (a limited tenant)


def run(*argv: str, timeout_s: float = 900, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **env})
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
    return proc


def counts_actor_exists() -> bool:
    probe = ("import ray; ray.init(address='auto', logging_level='ERROR'); "
             f"ray.get_actor({SHARED_NAME!r}, namespace={SHARED_NAMESPACE!r}); print('yes')")
    proc = run(str(REPO_ROOT / ".venv" / "bin" / "python"), "-c", probe, timeout_s=120,
               RAY_AUTH_MODE="disabled")
    return proc.returncode == 0 and "yes" in proc.stdout


def test_stop_leaves_nothing_running(tmp_path):
    if full_stop.ray_processes():
        pytest.skip("a Ray cluster already runs on this host: scripts/stop.sh would stop it "
                    "too; run this test alone (see its docstring)")
    if taken := full_stop.listeners():
        pytest.skip(f"demo ports in use: {taken}")
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(on_engine(load_yaml(REPO_ROOT / "serve_configs" /
                                                         "tenants.yaml"), TEST_ENGINE),
                                     sort_keys=False))
    observability = None
    try:
        demo = run("./scripts/demo.sh", str(config), MESH_API_KEY=ACME_KEY)
        assert demo.returncode == 0, demo.stderr[-3000:]
        # the metrics port the demo pins, which meshctl top-adapters reads by default
        assert httpx.get("http://127.0.0.1:8080/metrics", timeout=30).status_code == 200
        assert counts_actor_exists(), "the limited tenant's request made no counts actor"

        observability = subprocess.Popen(["./scripts/observability.sh"], cwd=REPO_ROOT,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
        deadline = time.monotonic() + 120
        while not full_stop.PROMETHEUS_PID_FILE.exists():
            assert observability.poll() is None, observability.stdout.read()
            assert time.monotonic() < deadline, "Prometheus did not start"
            time.sleep(1)
        prometheus_pid = int(full_stop.PROMETHEUS_PID_FILE.read_text())

        stop = run("./scripts/stop.sh", timeout_s=300)
        assert stop.returncode == 0, stop.stdout
        assert "[stop] nothing left running" in stop.stdout
        assert full_stop.leftovers() == []
        assert not full_stop._alive(prometheus_pid)
        assert observability.wait(timeout=60) is not None  # the script ended with it
    finally:
        if observability is not None and observability.poll() is None:
            observability.kill()
        if full_stop.ray_processes():  # the test failed half-way: leave the host clean
            run("./scripts/stop.sh", timeout_s=300)
