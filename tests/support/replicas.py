"""A variant's replicas on the test cluster (Serve's status), the processes its engine runs in,
and a stream cut by killing them."""

from __future__ import annotations

import time

import httpx
import psutil

from serve_app.release.deploy import serve_status


def replicas(mesh, app: str = "smollm-v2") -> list[dict]:
    """The replicas of ``app``'s LLMReplica deployment, as Serve's status lists them."""
    dep = serve_status(mesh.dashboard)["applications"].get(app, {}).get(
        "deployments", {}).get("LLMReplica", {})
    return dep.get("replicas", [])


def running(mesh, app: str = "smollm-v2") -> list[dict]:
    return [r for r in replicas(mesh, app) if r["state"] == "RUNNING"]


def engine_processes(replica_pid: int, engine: str) -> list[psutil.Process]:
    """The processes a replica's engine runs in: vLLM's (EngineCore and any Worker) that the
    replica started, or, for the simulated engine, the replica's own."""
    if engine == "sim":
        return [psutil.Process(replica_pid)]
    return [p for p in psutil.Process(replica_pid).children(recursive=True)
            if p.name().startswith("VLLM::")]


def stream_and_kill(http: httpx.Client, body: dict, headers: dict, variant: str, kill,
                    after_lines: int = 5) -> tuple[list[str], float]:
    """Stream ``body`` (answered by ``variant``), call ``kill()`` once after ``after_lines``
    SSE lines, and read the stream to its end. Returns its non-empty lines and the
    ``time.monotonic()`` of the kill."""
    lines: list[str] = []
    killed_at = None
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.headers["x-mesh-variant"] == variant
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == after_lines and killed_at is None:
                killed_at = time.monotonic()
                kill()
    return lines, killed_at
