"""The operating guide's stop, without a cluster: ``scripts/observability.sh`` stops its
Prometheus on SIGTERM (a stand-in ``prometheus`` binary that answers ``/-/ready``), and the
full stop's parts (``bench.full_stop``) find and stop what they should. The full
stop of a real demo mesh is ``tests/integration/test_full_stop.py`` (integration)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from serve_app.common.paths import REPO_ROOT
from bench import full_stop
from bench.servers import free_port

#: A stand-in for Debian's prometheus: serves 200 on every path at --web.listen-address.
FAKE_PROMETHEUS = '''#!{python}
import http.server, sys
addr = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--web.listen-address="))
host, port = addr.rsplit(":", 1)
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer((host, int(port)), Ok).serve_forever()
'''


@pytest.fixture
def fake_prometheus(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "prometheus"
    exe.write_text(FAKE_PROMETHEUS.format(python=sys.executable))
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def started(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """The Prometheus pid the tool prints once it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("[prometheus] pid "):
            return int(line.split()[2].rstrip(","))
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"did not start: {proc.stdout.read()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_observability_stops_its_prometheus_on_a_signal(fake_prometheus, tmp_path, sig):
    port, data = free_port(), tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "bench.local_prometheus", "--port",
                             str(port), "--data-dir", str(data)], env=fake_prometheus,
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        pid = started(proc)
        assert (data / "prometheus.pid").read_text().strip() == str(pid)
        assert psutil.pid_exists(pid)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert not full_stop._alive(pid), "Prometheus outlived observability.sh"
    assert not (data / "prometheus.pid").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_stop_prometheus_from_its_pid_file(tmp_path):
    pid_file = tmp_path / "prometheus.pid"
    assert full_stop.stop_prometheus(pid_file).startswith("no pid file")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pid_file.write_text(f"{sleeper.pid}\n")
    assert full_stop.stop_prometheus(pid_file, timeout_s=10) == f"stopped pid {sleeper.pid}"
    assert sleeper.wait(timeout=10) == -signal.SIGTERM and not pid_file.exists()
    pid_file.write_text(f"{sleeper.pid}\n")  # gone already: nothing to stop
    assert full_stop.stop_prometheus(pid_file) == f"pid {sleeper.pid} was not running"


def test_leftovers_name_the_ports_still_in_use(tmp_path):
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert full_stop.listeners({port: "something"}) == [(port, "something")]
    assert full_stop.listeners({port: "something"}) == []
    pid_file = tmp_path / "p.pid"
    pid_file.write_text("1\n")
    assert f"Prometheus: {pid_file} is still there" in full_stop.leftovers(
        keep_ray=True, pid_file=pid_file)


def test_ray_processes_are_found_as_ray_stop_finds_them():
    """A process of this user whose command line has a Ray process keyword is one."""
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                             "default_worker.py"])
    try:
        assert fake.pid in [pid for pid, _ in full_stop.ray_processes()]
    finally:
        fake.kill()
        fake.wait()


def test_the_demo_pins_the_metrics_port_top_adapters_reads():
    demo = (REPO_ROOT / "scripts" / "demo.sh").read_text()
    assert "--metrics-export-port=8080" in demo
    from serve_app.cli import build_parser

    top = build_parser().parse_args(["top-adapters", "x.yaml"])
    assert top.metrics == "http://127.0.0.1:8080/metrics"
    assert "./scripts/stop.sh" in demo and Path(REPO_ROOT / "scripts" / "stop.sh").is_file()
