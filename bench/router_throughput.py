"""What the mesh costs per request against vLLM's own server on the same simulated engine
(``bench.py --router-throughput``): requests/s at saturation, TTFT at one in flight, and the
CPU per request of every process the mesh adds, side by side, in one run.

Starts vLLM's own OpenAI server on the simulated engine (:mod:`bench.direct_sim`: the
variant's model directory and args, profile cpu-smollm2 at ``time_scale`` 0.01, at
``--direct-nice``, default 15, as Ray runs the mesh's processes), then for each ingress
(``--ingress proxy|haproxy|both``; default ``$MESH_INGRESS`` or the mesh's default,
:mod:`serve_app.common.serve_env`) its own Ray cluster (free ports, 127.0.0.1) with
``--config`` deployed (default serve_configs/tenants.yaml, every variant on the same simulated
engine; the load is a limited tenant's, its token and request budgets lifted far above it
and no concurrency limit, so it is counted as a busy budgeted tenant is: on the router's
budget lease, or with ``--leases off`` (or ``both``, off then on, redeployed in place in the
same cluster) by asking the ledger for each request), and with ``--headroom`` each value of
every route's ``admission.headroom`` in turn (redeployed in place). Then, against the mesh and
against vLLM's server alike:

- ``--rounds`` alternations (vLLM's server, then the mesh) of ``--requests`` / rounds
  streamed chats at ``--concurrency`` (32, saturation), ``--max-tokens`` each: requests/s;
- ``--ttft-requests`` streamed chats one at a time: TTFT p50, and the mesh's overhead;
- the CPU (user + system, psutil) each process spent during its side's loads, per answered
  request, less what it spends idle (measured for 10 s first): by role
  (:mod:`bench.mesh_processes`), the mesh's own roles summed, against the variant replica's
  and vLLM's own server's.

With ``--profile``, py-spy then records a router replica and a variant replica under the same
load for ``--profile-s`` seconds and the summary says where their CPU goes (:mod:`bench.pyspy`).

CPU seconds per request are what the host's sharing changes least (the wall clock is shared
with the client on 2 cores), so one core's ceiling for a process is 1 / its CPU s per request.
The engine is simulated: every figure is of the simulated engine, profile cpu-smollm2 x 0.01.

    python scripts/bench.py --router-throughput [--ingress proxy|haproxy|both]
        [--leases on|off|both] [--headroom 0.25 1 ...] [--config serve_configs/tenants.yaml] [--requests 600] [--rounds 3]
        [--concurrency 32] [--max-tokens 16] [--ttft-requests 100] [--profile] [--json FILE]
"""

from __future__ import annotations

import asyncio
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench import pyspy
from bench.direct_sim import PROFILE, TIME_SCALE
from bench.direct_vllm import start_direct
from bench.loadgen import LoadSpec, background_load, run_load, summarize
from bench.mesh_processes import (MESH_ROLES, ROLES, CpuMeter, CpuSpent, mesh_processes,
                                  per_request_ms)
from bench.servers import start_local_ray
from serve_app.common.serve_configs import load_yaml, on_sim_engine
from serve_app.common.serve_env import DEFAULT_INGRESS, INGRESSES, chosen_ingress, serve_env
from serve_app.release.deploy import deploy

#: Seconds the processes' idle CPU is measured for (subtracted from the load's).
IDLE_S = 10.0
#: The demo tenant with limits on tenants.yaml: every request asks the ledger, as a limited
#: tenant's does; the limits are lifted far above the load (:func:`lifted`).
API_KEY, TENANT = "sk-initech-demo", "initech"
#: The goals the figures are held to (printed met or not; a benchmark, not a test).
GOALS = {
    # ratios to vLLM's own OpenAI server on the same simulated engine, in the same run
    "mesh_cpu_over_direct": 1.0,  # the mesh's own CPU per request / vLLM's server's, at most
    "replica_over_direct": 1.3,  # the variant replica's CPU per request / vLLM's server's
    "mesh_over_direct": 0.7,  # requests/s at saturation, mesh / vLLM's own server, at least
    "ttft_overhead_ms": 3.0,  # TTFT p50 at concurrency 1, mesh - vLLM's own server, at most
}


def lifted(cfg: dict, leases: bool = True, headroom: float | None = None) -> dict:
    """``cfg`` with :data:`TENANT`'s budgets far above any load this host can send and no
    concurrency limit (a tenant with one asks the ledger for every request's slot, leases
    or not), the router's budget leases on or off (``ledger.leases``), and with
    ``headroom`` every route's ``admission.headroom`` (None: the config's own)."""
    for app in cfg["applications"]:
        for dep in app.get("deployments", []):
            user_config = dep.get("user_config") or {}
            if "tenants" not in user_config:
                continue
            user_config.setdefault("ledger", {})["leases"] = leases
            if headroom is not None:
                for route in user_config.get("routes", {}).values():
                    route.setdefault("admission", {})["headroom"] = headroom
            for tenant in user_config["tenants"]:
                if tenant["id"] == TENANT:
                    tenant.pop("max_concurrent_requests", None)
                    tenant.update(requests_per_minute=10_000_000,
                                  tokens_per_minute=10_000_000_000)
    return cfg


def lease_choices(choice: str) -> list[bool]:
    """The budget-lease settings to measure for ``--leases``: on, off, or both (off first,
    the baseline)."""
    return {"on": [True], "off": [False], "both": [False, True]}[choice]


def ingresses(choice: str | None) -> list[str]:
    """The ingresses to measure for ``--ingress`` (None: ``$MESH_INGRESS``, else the
    mesh's default; ``both``: every one, today's default first).

    Raises:
        ValueError: an unknown ingress.
    """
    if choice == "both":
        return [DEFAULT_INGRESS, *(i for i in INGRESSES if i != DEFAULT_INGRESS)]
    return [chosen_ingress(choice)]


def wait_for_ingress(base: str, timeout_s: float = 120) -> None:
    """Wait until the mesh answers on ``base`` (``http://host:port``): Serve's ``/-/routes``
    lists the router's route and the router's ``/health`` is 200 (HAProxy takes the routes
    a moment after the deploy is RUNNING).

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            routes = httpx.get(f"{base}/-/routes", timeout=5)
            if (routes.status_code == 200 and "/" in routes.json()
                    and httpx.get(f"{base}/health", timeout=5).status_code == 200):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the mesh did not answer {base}/-/routes and /health in {timeout_s} s")


class _Side:
    """One side of the comparison: a load target, its processes' CPU, its results."""

    def __init__(self, url: str, find, api_key: str, a) -> None:
        self.spec = LoadSpec(base_url=url, model=a.model, requests=a.requests,
                             concurrency=a.concurrency, max_tokens=a.max_tokens,
                             api_key=api_key)
        self.meter = CpuMeter(find)
        self.loads = CpuSpent({}, 0.0)
        self.results: list = []

    def load(self, requests: int) -> None:
        self.meter.start()
        self.results += asyncio.run(run_load(LoadSpec(**{**self.spec.__dict__,
                                                           "requests": requests})))
        self.loads = self.loads + self.meter.stop()

    def ttft(self, requests: int) -> dict[str, Any]:
        results = asyncio.run(run_load(LoadSpec(**{**self.spec.__dict__, "requests": requests,
                                                   "concurrency": 1})))
        return summarize(results, 1.0)

    def figures(self, idle: CpuSpent) -> dict[str, Any]:
        n = sum(1 for r in self.results if r.ok)
        s = summarize(self.results, self.loads.wall_s)
        return {"answered": n, "errors": s["errors"], "wall_s": self.loads.wall_s,
                "requests_per_s": n / self.loads.wall_s if self.loads.wall_s else 0.0,
                "ttft_p50_ms_at_saturation": s["ttft_p50_ms"],
                "latency_p50_ms_at_saturation": s["latency_p50_ms"],
                "cpu_ms": per_request_ms(self.loads, idle, n)}


def measure(a, ingress: str, direct_url: str, direct_pids) -> list[dict[str, Any]]:
    """One ingress: its own cluster and mesh, against the running direct server (module
    docstring), once per ``--leases`` setting (redeployed in place). Returns each run's
    figures (:func:`run_figures`)."""
    import ray

    dashboard, http_port, _ = start_local_ray(serve_env(ingress))
    base = f"http://127.0.0.1:{http_port}"
    try:
        runs = []
        for leases in lease_choices(a.leases):
            for headroom in a.headroom or [None]:
                cfg = lifted(on_sim_engine(load_yaml(a.config), profile=PROFILE,
                                           time_scale=TIME_SCALE, start_s=0), leases, headroom)
                cfg["http_options"] = {"host": "127.0.0.1", "port": http_port}
                path = Path(tempfile.mkdtemp(prefix="bench-router-")) / "mesh.yaml"
                path.write_text(yaml.safe_dump(cfg, sort_keys=False))
                label = f"{ingress}, leases {'on' if leases else 'off'}" + (
                    "" if headroom is None else f", headroom {headroom:g}")
                print(f"[bench] {label}: serve deploy {a.config} on the simulated engine",
                      flush=True)
                deploy(path, dashboard, log=lambda m: None)
                wait_for_ingress(base)
                runs.append(_measure_mesh(a, label, base, direct_url, direct_pids))
        return runs
    finally:
        ray.shutdown()


def _measure_mesh(a, label: str, base: str, direct_url: str, direct_pids) -> dict[str, Any]:
    """The loads, TTFT and (``--profile``) the router's profile of the mesh deployed at
    ``base``, against the direct server, as ``label``."""
    mesh = _Side(f"{base}/v1", mesh_processes, API_KEY, a)
    direct = _Side(direct_url, lambda: {"direct": direct_pids()}, "none", a)
    for side in (direct, mesh):  # warm up
        asyncio.run(run_load(LoadSpec(**{**side.spec.__dict__, "requests": 32})))
    # what each process spends with no request (polls, metrics), to subtract
    idle_mesh, idle_direct = CpuMeter(mesh_processes), CpuMeter(
        lambda: {"direct": direct_pids()})
    idle_mesh.start()
    idle_direct.start()
    time.sleep(IDLE_S)
    both = idle_mesh.stop(), idle_direct.stop()
    idle = CpuSpent({**both[0].seconds, **both[1].seconds}, both[0].wall_s)
    rounds = max(1, a.rounds)
    for i in range(rounds):
        n = a.requests // rounds + (1 if i < a.requests % rounds else 0)
        print(f"[bench] {label}: round {i + 1}/{rounds}: {n} requests at "
              f"{a.concurrency} in flight to vLLM's server, then to the mesh", flush=True)
        direct.load(n)
        mesh.load(n)
    print(f"[bench] {label}: TTFT at 1 in flight, {a.ttft_requests} requests each",
          flush=True)
    ttft_direct = direct.ttft(a.ttft_requests)
    ttft_mesh = mesh.ttft(a.ttft_requests)
    roles = mesh_processes()
    profiles = {}
    if a.profile:
        profiles = profile_processes(mesh.spec, {role: roles.get(role, [])
                                                 for role in PROFILED}, a.profile_s)
    return run_figures(label, mesh.figures(idle), direct.figures(idle), ttft_mesh,
                       ttft_direct, {r: len(p) for r, p in roles.items()}, profiles)


#: The roles ``--profile`` records, each its first process.
PROFILED = ("router", "replica")


def profile_processes(spec: LoadSpec, pids: dict[str, list[int]], seconds: float
                      ) -> dict[str, dict]:
    """py-spy's record of the first process of each role in ``pids`` (role -> pids), all at
    once for ``seconds`` under ``spec``'s load, summarized (:func:`bench.pyspy.summarize`):
    role -> profile; a role py-spy could not record is left out (printed)."""
    from concurrent.futures import ThreadPoolExecutor

    found = {role: p[0] for role, p in pids.items() if p}
    for role in set(pids) - set(found):
        print(f"[bench] --profile: no {role} process found", flush=True)
    named = ", ".join(f"the {role} (pid {pid})" for role, pid in found.items())
    print(f"[bench] --profile: py-spy records {named} for {seconds:.0f} s under the same "
          "load", flush=True)

    def record(pid: int):
        try:
            return pyspy.summarize(pyspy.record(pid, seconds)).as_json()
        except RuntimeError as e:
            print(f"[bench] --profile: {e}", flush=True)
            return None
    with background_load(LoadSpec(**{**spec.__dict__, "duration_s": seconds + 5})):
        time.sleep(2)  # the load in full flow
        with ThreadPoolExecutor(len(found) or 1) as pool:
            results = dict(zip(found, pool.map(record, found.values())))
    return {role: p for role, p in results.items() if p is not None}


def run_figures(ingress: str, mesh: dict, direct: dict, ttft_mesh: dict, ttft_direct: dict,
                processes: dict[str, int], profiles: dict[str, dict]) -> dict[str, Any]:
    """One ingress's figures, with the sums and ratios the goals are about (the ratios to
    vLLM's own server: the mesh's own CPU, the variant replica's, requests/s)."""
    cpu = mesh["cpu_ms"]
    own = sum(cpu.get(r, 0.0) for r in MESH_ROLES)
    replica = cpu.get("replica", 0.0)
    direct_cpu = direct["cpu_ms"].get("direct", 0.0)
    return {
        "ingress": ingress, "processes": processes, "mesh": mesh, "direct": direct,
        "ttft_p50_ms": {"mesh": ttft_mesh["ttft_p50_ms"], "direct": ttft_direct["ttft_p50_ms"]},
        "ttft_errors": {"mesh": ttft_mesh["errors"], "direct": ttft_direct["errors"]},
        "ttft_overhead_ms": ttft_mesh["ttft_p50_ms"] - ttft_direct["ttft_p50_ms"],
        "mesh_over_direct": (mesh["requests_per_s"] / direct["requests_per_s"]
                             if direct["requests_per_s"] else 0.0),
        "mesh_cpu_ms": own, "replica_cpu_ms": replica, "direct_cpu_ms": direct_cpu,
        "mesh_over_replica": own / replica if replica else float("inf"),
        "mesh_cpu_over_direct": own / direct_cpu if direct_cpu else float("inf"),
        "replica_over_direct": replica / direct_cpu if direct_cpu else float("inf"),
        "profiles": profiles,
    }


def _ms(x: float) -> str:
    return f"{x:.1f}"


def table(runs: list[dict[str, Any]]) -> list[str]:
    """The runs side by side, one column per ingress, as a Markdown table: requests/s at
    saturation and mesh/direct, TTFT p50 at 1 in flight and the overhead, CPU ms per request
    of each role, the mesh's own sum, the variant replica's and vLLM's own server's, and the
    mesh's own / the variant replica's."""
    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(r) for r in runs) + " |"

    def cpu(role: str):
        return lambda r: (_ms(r["mesh"]["cpu_ms"][role]) if role in r["mesh"]["cpu_ms"]
                          else "–")

    out = ["| figure | " + " | ".join(f"ingress: {r['ingress']}" for r in runs) + " |",
           "|---|" + "---|" * len(runs),
           row("requests/s at saturation: mesh / vLLM's server (ratio)", lambda r: (
               f"{r['mesh']['requests_per_s']:.1f} / {r['direct']['requests_per_s']:.1f} "
               f"(**{r['mesh_over_direct']:.2f}**)")),
           row("errors: mesh / vLLM's server", lambda r: (
               f"{r['mesh']['errors'] + r['ttft_errors']['mesh']} / "
               f"{r['direct']['errors'] + r['ttft_errors']['direct']}")),
           row("TTFT p50 at 1 in flight: mesh / vLLM's server, ms (overhead)", lambda r: (
               f"{_ms(r['ttft_p50_ms']['mesh'])} / {_ms(r['ttft_p50_ms']['direct'])} "
               f"(**{r['ttft_overhead_ms']:+.1f}**)"))]
    for role in MESH_ROLES:
        if any(role in r["mesh"]["cpu_ms"] for r in runs):
            out.append(row(f"CPU ms/request: {ROLES[role]}", cpu(role)))
    out += [row("**CPU ms/request: the mesh's own (sum of the above)**",
                lambda r: f"**{_ms(r['mesh_cpu_ms'])}**"),
            row(f"CPU ms/request: {ROLES['replica']}", cpu("replica")),
            row("CPU ms/request: vLLM's own server (direct)", lambda r: _ms(r["direct_cpu_ms"])),
            row("the mesh's own CPU / vLLM's server's",
                lambda r: f"**{r['mesh_cpu_over_direct']:.2f}**"),
            row("the variant replica's CPU / vLLM's server's",
                lambda r: f"**{r['replica_over_direct']:.2f}**"),
            row("the mesh's own / variant replica's CPU",
                lambda r: f"{r['mesh_over_replica']:.2f}")]
    if any("ray" in r["mesh"]["cpu_ms"] for r in runs):
        out.append(row(f"CPU ms/request: {ROLES['ray']}, not in the sum", cpu("ray")))
    return out


def goal_lines(run: dict[str, Any]) -> list[str]:
    """Each goal of :data:`GOALS`, the run's figure, and whether it is met."""
    g = GOALS
    checks = [
        (f"the mesh's own CPU <= {g['mesh_cpu_over_direct']} x vLLM's server's",
         run["mesh_cpu_over_direct"] <= g["mesh_cpu_over_direct"],
         f"{run['mesh_cpu_over_direct']:.2f} ({run['mesh_cpu_ms']:.1f} / "
         f"{run['direct_cpu_ms']:.1f} ms)"),
        (f"the variant replica's CPU <= {g['replica_over_direct']} x vLLM's server's",
         run["replica_over_direct"] <= g["replica_over_direct"],
         f"{run['replica_over_direct']:.2f} ({run['replica_cpu_ms']:.1f} / "
         f"{run['direct_cpu_ms']:.1f} ms)"),
        (f"mesh / vLLM's server requests/s >= {g['mesh_over_direct']}",
         run["mesh_over_direct"] >= g["mesh_over_direct"], f"{run['mesh_over_direct']:.2f}"),
        (f"TTFT overhead <= {g['ttft_overhead_ms']} ms",
         run["ttft_overhead_ms"] <= g["ttft_overhead_ms"], f"{run['ttft_overhead_ms']:+.1f} ms"),
    ]
    return [f"  {'met    ' if ok else 'NOT met'}  {what}: {figure}" for what, ok, figure in checks]


def run(a) -> None:
    """The benchmark (see the module docstring); ``a``: bench.py's arguments."""
    import psutil

    chosen = ingresses(a.ingress)
    proc, direct_url, _, _ = start_direct(a.config, a.variant, a.direct_nice,
                                          sim=(PROFILE, TIME_SCALE))

    def direct_pids() -> list[int]:
        try:
            return [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(True))]
        except psutil.NoSuchProcess:
            return []

    runs = []
    try:
        for ingress in chosen:
            runs += measure(a, ingress, direct_url, direct_pids)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"\n{a.requests} streamed chats at {a.concurrency} in flight in {a.rounds} rounds, "
          f"{a.max_tokens} tokens each, TTFT over {a.ttft_requests} at 1 in flight; {a.config} "
          f"and vLLM's own server on the simulated engine ({PROFILE} x {TIME_SCALE}); "
          f"vLLM's server at nice {a.direct_nice}, the mesh at Ray's (15); host: "
          f"{psutil.cpu_count()} cores, {platform.machine()}\n")
    print("\n".join(table(runs)))
    for r in runs:
        print(f"\ngoals, ingress {r['ingress']}:")
        print("\n".join(goal_lines(r)))
        for role, profile in r["profiles"].items():
            print(f"\nwhere the {ROLES[role]}'s CPU goes (py-spy, ingress {r['ingress']}):")
            print("\n".join(pyspy.Profile.from_json(profile).lines()))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "benchmark": "router-throughput", "command": " ".join(sys.argv),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": {"cores": psutil.cpu_count(), "machine": platform.machine(),
                     "node": platform.node()},
            "config": a.config, "engine": {"profile": PROFILE, "time_scale": TIME_SCALE},
            "requests": a.requests, "rounds": a.rounds, "concurrency": a.concurrency,
            "max_tokens": a.max_tokens, "ttft_requests": a.ttft_requests,
            "direct_nice": a.direct_nice, "goals": GOALS, "runs": runs}, indent=2))
        print(f"\n[bench] figures written to {a.json}")
