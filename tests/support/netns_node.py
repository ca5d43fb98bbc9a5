"""A Ray worker node in its own network namespace on this host
(tests/integration/test_multi_node.py).

Two Ray nodes on one host would both run a Serve proxy on the same 127.0.0.1:port under
``proxy_location: EveryNode``. In a network namespace of its own, the worker node has its
own loopback and its own address (``10.231.0.2``), joined to the host by a veth pair; the
host reaches it at that address, and it reaches the head at the head's address. Needs root
(``ip netns``), as CI has here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

HOST_IP, NODE_IP, PREFIX = "10.231.0.1", "10.231.0.2", 24


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _veth(pid: int) -> str:
    """The veth pair's name stem of the namespace test run ``pid`` makes (``<stem>h`` on the
    host, ``<stem>w`` in the namespace; interface names are at most 15 characters)."""
    return f"v{pid % 100000}"


def remove_stale_nodes() -> None:
    """Remove what a killed test run left: its ``mesh-<pid>`` namespace and its host-side
    veth. Every such veth holds HOST_IP with a route to the namespaces' subnet, and the first
    route wins: a stale one sends the head's traffic for the new node into a dead namespace
    (seen in CI: ``ray start`` of the new node failed)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True,
                           text=True).stdout.split()
    for name in names:
        pid = name.removeprefix("mesh-")
        if name.startswith("mesh-") and pid.isdigit() and not psutil.pid_exists(int(pid)):
            for p in _processes_in(name):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{_veth(int(pid))}h"], capture_output=True)


def _processes_in(name: str) -> list[psutil.Process]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                         text=True).stdout.split()
    procs = []
    for pid in out:
        try:
            procs.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            pass
    return procs


class NamespacedNode:
    """``ray start`` of a worker node inside network namespace ``name``.

    Args:
        gcs_address: the head's ``host:port`` (reachable from the namespace: not loopback).
        resources: the node's custom resources; it has no CPUs, so only what asks for one
            of these lands there.
        env: the environment of its Ray processes.
    """

    def __init__(self, name: str, gcs_address: str, resources: dict[str, float],
                 env: dict[str, str]) -> None:
        if gcs_address.startswith("127."):
            raise RuntimeError(f"the head's GCS is on {gcs_address}: a namespace cannot "
                               "reach the host's loopback")
        self.name, self.gcs_address, self.resources, self.env = name, gcs_address, resources, env
        self.veth = _veth(os.getpid())

    def start(self) -> None:
        self.stop()
        remove_stale_nodes()
        _ip("netns", "add", self.name)
        _ip("link", "add", f"{self.veth}h", "type", "veth", "peer", "name", f"{self.veth}w")
        _ip("link", "set", f"{self.veth}w", "netns", self.name)
        _ip("addr", "add", f"{HOST_IP}/{PREFIX}", "dev", f"{self.veth}h")
        _ip("link", "set", f"{self.veth}h", "up")
        inside = ["netns", "exec", self.name, "ip"]
        _ip(*inside, "addr", "add", f"{NODE_IP}/{PREFIX}", "dev", f"{self.veth}w")
        _ip(*inside, "link", "set", f"{self.veth}w", "up")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "route", "add", "default", "via", HOST_IP)
        ray = str(Path(sys.executable).parent / "ray")
        started = subprocess.run(["ip", "netns", "exec", self.name, ray, "start",
                                  f"--address={self.gcs_address}", f"--node-ip-address={NODE_IP}",
                                  "--num-cpus=0", f"--resources={json.dumps(self.resources)}",
                                  "--object-store-memory=200000000", "--disable-usage-stats"],
                                 env=self.env, capture_output=True, text=True)
        if started.returncode != 0:
            raise RuntimeError(f"`ray start` of the worker node exited {started.returncode}:\n"
                               f"{started.stdout[-3000:]}\n{started.stderr[-3000:]}")

    def processes(self) -> list[psutil.Process]:
        """Every process in the namespace (Ray's, and the engines its replicas started)."""
        return _processes_in(self.name)

    def force_stop(self) -> None:
        """What ``ray stop --force`` does on this node: SIGKILL every Ray process in it (the
        raylet, the agents, the workers: replicas and the proxy), all at once. vLLM's engine
        processes and the mesh's engine reaper are not Ray's, and are left alone."""
        for p in self.processes():
            try:
                if not p.name().startswith("VLLM::") and "engine_reaper" not in " ".join(
                        p.cmdline()):
                    p.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        """Kill everything in the namespace and remove it."""
        if shutil.which("ip") is None:
            return
        procs = self.processes() if Path(f"/run/netns/{self.name}").exists() else []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        # `ray start --address` recorded the head as this host's current cluster: forget it,
        # so a later `ray.init()` or `ray status` does not look for a cluster that is gone.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip() == self.gcs_address:
            current.unlink()
        subprocess.run(["ip", "link", "del", f"{self.veth}h"], capture_output=True)
        time.sleep(0.2)
