"""Run a real Prometheus server against the mesh's Ray cluster (``scripts/observability.sh``,
``tests/integration/test_observability.py``), and wait for what it scrapes.

The server is Debian's ``prometheus`` package (2.42). Its config is the repo's
``deploy/prometheus/prometheus.yml``, with the scrape interval and Ray's service-discovery
file (``<ray temp dir>/prom_metrics_service_discovery.json``, which lists every node's metrics
export port) filled in. It listens on 127.0.0.1 only.

    python -m bench.local_prometheus [--port 9090] [--data-dir /tmp/mesh-prometheus]

runs it in the foreground until Ctrl-C, SIGTERM or SIGHUP, which stop Prometheus too. While
it runs, ``<data dir>/prometheus.pid`` holds Prometheus's pid, so ``scripts/stop.sh`` can
stop one started in the background (``./scripts/observability.sh &``). Its queries are the
product's (:mod:`serve_app.observability.prometheus`).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import yaml

from bench.script_args import ScriptError, run, script_parser
from bench.servers import ServerDidNotStart, wait_until_ready
from serve_app.common.paths import REPO_ROOT
from serve_app.observability.prometheus import PrometheusError, query

CONFIG_TEMPLATE = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
RAY_SD_FILE = Path("/tmp/ray/prom_metrics_service_discovery.json")


def write_config(path: Path, *, sd_file: Path = RAY_SD_FILE, scrape_interval_s: int = 5) -> Path:
    """The repo's config with ``sd_file`` and ``scrape_interval_s`` filled in, at ``path``."""
    config = yaml.safe_load(CONFIG_TEMPLATE.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = \
        f"{scrape_interval_s}s"
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(sd_file)]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start(port: int = 9090, *, data_dir: Path | None = None, sd_file: Path = RAY_SD_FILE,
          scrape_interval_s: int = 5, log=print) -> tuple[subprocess.Popen, str]:
    """Start Prometheus on 127.0.0.1:``port``; wait until it is ready.

    Returns:
        The process and its base URL.

    Raises:
        PrometheusError: the ``prometheus`` binary is missing (install Debian's package:
            ``apt-get install prometheus``), or it did not become ready in 60 s.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        raise PrometheusError("the prometheus binary is not installed: run "
                              "scripts/observability.sh, or apt-get install prometheus")
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="mesh-prometheus-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    config = write_config(data_dir / "prometheus.yml", sd_file=sd_file,
                          scrape_interval_s=scrape_interval_s)
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
         f"--storage.tsdb.path={data_dir / 'data'}", "--web.enable-lifecycle"],
        stdout=open(data_dir / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_until_ready(proc, f"{url}/-/ready", what="prometheus",
                         log_path=str(data_dir / "prometheus.log"), timeout_s=60, every_s=0.5)
    except ServerDidNotStart as e:
        stop(proc)
        raise PrometheusError(str(e)) from None
    except BaseException:  # interrupted while it starts: it must not outlive the caller
        stop(proc)
        raise
    log(f"[prometheus] ready at {url} (config {config}, scraping the targets in {sd_file})")
    return proc, url


def without_data(url: str, queries: list[tuple[str, str]], timeout_s: float,
                 every_s: float = 3) -> list[str]:
    """The titles of ``(title, PromQL)`` queries that returned no data within ``timeout_s``
    (each asked again every ``every_s`` until it does)."""
    import time

    missing = dict(queries)
    deadline = time.monotonic() + timeout_s
    while missing and time.monotonic() < deadline:
        for title, promql in list(missing.items()):
            if query(url, promql):
                del missing[title]
        if missing:
            time.sleep(every_s)
    return sorted(missing)


def target_errors(url: str) -> list[str]:
    """Why scrapes fail: ``"<scrape url>: <last error>"`` for each active target that is not
    up (``/api/v1/targets``); empty when every target is scraped."""
    body = httpx.get(f"{url}/api/v1/targets", params={"state": "active"}, timeout=30).json()
    return [f"{t['scrapeUrl']}: {t.get('lastError') or t['health']}"
            for t in body["data"]["activeTargets"] if t["health"] != "up"]


#: The pid file of the Prometheus that :func:`main` runs, in its data directory.
PID_FILE = "prometheus.pid"


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM to Prometheus (it flushes its data), SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    import signal

    def serve() -> int:
        p = script_parser(__doc__, prog="observability.sh")
        p.add_argument("--port", type=int, default=9090, help="Prometheus's port on 127.0.0.1")
        p.add_argument("--data-dir", type=Path, default=Path("/tmp/mesh-prometheus"),
                       help="its config, log, pid file and data")
        p.add_argument("--sd-file", type=Path, default=RAY_SD_FILE,
                       help="Ray's service-discovery file of the metrics export ports")
        a = p.parse_args()
        pid_file = a.data_dir / PID_FILE

        def leave(signum, _frame) -> None:
            raise SystemExit(128 + signum)

        # Before Prometheus starts. SIGINT too: a shell that starts a job in the background
        # (`... &`) has it ignored, and Python then leaves it ignored (no KeyboardInterrupt).
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, leave)
        proc = None
        try:
            try:
                proc, url = start(a.port, data_dir=a.data_dir, sd_file=a.sd_file)
            except PrometheusError as e:
                raise ScriptError(str(e)) from None
            pid_file.write_text(f"{proc.pid}\n")
            print(f"[prometheus] pid {proc.pid}, {url}; Ctrl-C or SIGTERM to this script "
                  "stops it", flush=True)
            return proc.wait()
        finally:
            if proc is not None:
                stop(proc)
                pid_file.unlink(missing_ok=True)
                print("[prometheus] stopped", flush=True)

    run(serve)


if __name__ == "__main__":
    main()
