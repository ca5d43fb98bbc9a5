"""The processes of a running mesh by role, and the CPU each role spends while a load runs
(``bench.py --router-throughput``).

Roles (:data:`ROLES`, in the order the tables show them): what the mesh adds in front of and
beside the engine (:data:`MESH_ROLES`: the ingress, the router replicas, the tenant ledger,
Serve's controller, the rollout controller, and any other actor of the mesh), the variant
replicas (vLLM's OpenAI layer and the engine, what vLLM's own server also runs), and Ray's
own daemons (GCS, raylet, dashboard and agents: shown, but not counted as the mesh's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

from bench.host_cpu import cpu_by_pid

#: role -> what the tables call it.
ROLES = {
    "proxy": "Serve's HTTP proxy (ProxyActor)",
    "haproxy": "HAProxy (haproxy + HAProxyManager)",
    "router": "router replicas (MeshRouter)",
    "ledger": "tenant ledger actor",
    "controller": "Serve controller",
    "rollout": "rollout controller (RolloutController)",
    "other": "other actors of the mesh",
    "replica": "variant replicas (LLMReplica)",
    "ray": "Ray's daemons (GCS, raylet, dashboard)",
}
#: The roles whose CPU is the mesh's own: what it runs that vLLM's own server does not.
MESH_ROLES = ("proxy", "haproxy", "router", "ledger", "controller", "rollout", "other")
#: Ray's daemons, by the start of their command line's first word or the title Ray gives them.
RAY_DAEMONS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
               "ray-dashboard-")
RAY_DAEMON_SCRIPTS = ("dashboard/dashboard.py", "_private/log_monitor.py",
                      "autoscaler/_private/monitor.py")


def actor_role(class_name: str) -> str | None:
    """The role of a live Ray actor from its class name (``ServeReplica:<app>:<deployment>``
    for a Serve replica); None for an actor that is not the mesh's (Ray's own, a driver's)."""
    if class_name.startswith("ServeReplica:"):
        deployment = class_name.rsplit(":", 1)[-1]
        return {"MeshRouter": "router", "RolloutController": "rollout",
                "LLMReplica": "replica"}.get(deployment, "other")
    if class_name == "HAProxyManager":
        return "haproxy"
    if class_name == "ProxyActor":
        return "proxy"
    if class_name == "ServeController":
        return "controller"
    if "Ledger" in class_name or class_name == "SharedTenantCounts":
        return "ledger"
    return None


def is_ray_daemon(cmdline: list[str]) -> bool:
    """Whether a process's command line is one of Ray's daemons (:data:`RAY_DAEMONS`)."""
    if not cmdline:
        return False
    first = cmdline[0].rsplit("/", 1)[-1]
    return (first.startswith(RAY_DAEMONS) or cmdline[0].startswith(RAY_DAEMONS)
            or any(arg.endswith(RAY_DAEMON_SCRIPTS) for arg in cmdline[1:3]))


def mesh_processes() -> dict[str, list[int]]:
    """Role -> pids of the live processes of the mesh's Ray cluster on this host: each actor
    by :func:`actor_role` (an HAProxyManager with its ``haproxy`` children), and Ray's
    daemons (``ray``). Needs ``ray.init`` to that cluster."""
    from ray.util.state import list_actors

    roles: dict[str, list[int]] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        role = actor_role(actor.class_name or "")
        if role and actor.pid:
            roles.setdefault(role, []).append(actor.pid)
    for pid in list(roles.get("haproxy", [])):
        roles["haproxy"] += [c.pid for c in _children(pid)]
    for p in psutil.process_iter(["cmdline"]):
        if is_ray_daemon(p.info["cmdline"] or []):
            roles.setdefault("ray", []).append(p.pid)
    return roles


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@dataclass
class CpuSpent:
    """CPU seconds (user + system) each role spent over a window, and the window's wall
    seconds."""

    seconds: dict[str, float]
    wall_s: float

    def __add__(self, other: CpuSpent) -> CpuSpent:
        """Two windows together (the rounds of one side of a benchmark)."""
        roles = self.seconds.keys() | other.seconds.keys()
        return CpuSpent({r: self.seconds.get(r, 0.0) + other.seconds.get(r, 0.0)
                         for r in roles}, self.wall_s + other.wall_s)


class CpuMeter:
    """The CPU seconds of each role's processes between :meth:`start` and :meth:`stop`.

    ``find`` (e.g. :func:`mesh_processes`) is asked for the roles' pids at both ends: a
    process that starts meanwhile (HAProxy reloads into a new process) counts all its CPU,
    one that exits meanwhile counts none of its last stretch."""

    def __init__(self, find) -> None:
        self._find = find

    def start(self) -> None:
        self._before = {role: cpu_by_pid(pids) for role, pids in self._find().items()}
        self._t0 = time.monotonic()

    def stop(self) -> CpuSpent:
        wall = time.monotonic() - self._t0
        spent = {}
        for role, pids in self._find().items():
            before = self._before.get(role, {})
            now = cpu_by_pid(pids)
            spent[role] = sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items())
        return CpuSpent(spent, wall)


def per_request_ms(load: CpuSpent, idle: CpuSpent, requests: int) -> dict[str, float]:
    """Role -> CPU ms per request of a load: the load's CPU seconds less the role's idle rate
    (``idle``: a window with no request) over the load's wall time, per request answered;
    never below 0. Source: the subtraction ``bench.py --router-throughput`` has always made
    (a process's polls and metrics are not the requests' cost)."""
    out = {}
    for role, seconds in load.seconds.items():
        idle_rate = idle.seconds.get(role, 0.0) / idle.wall_s if idle.wall_s else 0.0
        out[role] = max(0.0, seconds - idle_rate * load.wall_s) / max(1, requests) * 1000
    return out
