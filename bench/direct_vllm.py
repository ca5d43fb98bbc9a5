"""vLLM's own OpenAI server started like a variant of a Serve config (same model, engine args,
LoRA adapters and environment): the baseline the mesh is measured against. On the simulated
engine (``sim``), the same server runs the variant's simulated engine (:mod:`bench.direct_sim`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.servers import ServerDidNotStart, free_port, wait_until_ready
from serve_app.common.adapters import load_manifest, resolve_uri
from serve_app.common.config import ReplicaConfig, VariantArgs
from serve_app.common.deployment_options import replica_environment
from serve_app.common.paths import REPO_ROOT, resolve_model_path, resolve_repo_path
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment, load_yaml, mesh_parts


def vllm_flags(engine_args: dict) -> list[str]:
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):  # vLLM's config objects take JSON
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def variant_adapters(app: dict) -> dict[str, Path]:
    """The adapters the variant declares (first version of each name): name -> directory."""
    dep = deployment(app, REPLICA_DEPLOYMENT) or {}
    replica = ReplicaConfig.model_validate(dep.get("user_config") or {})
    if not replica.adapters:
        return {}
    registry = load_manifest(resolve_repo_path(replica.adapters_manifest)
                             if replica.adapters_manifest else None)
    out: dict[str, Path] = {}
    for ref in replica.adapters:
        out.setdefault(ref.name, resolve_uri(registry[ref.key].uri))
    return out


def start_direct(config_path: str, variant: str | None, nice: int = 0,
                 sim: tuple[str, float] | None = None):
    """Start vLLM's own server like the variant, at niceness ``nice``; with ``sim`` =
    (profile, time_scale), on the simulated engine (:mod:`bench.direct_sim`, no adapters).
    Returns (process, base url, served name, adapters served)."""
    parts = mesh_parts(load_yaml(config_path))
    app = parts.variant(variant)
    name = app["name"]
    args = VariantArgs.model_validate(app.get("args") or {})
    adapters = {} if sim else variant_adapters(app)
    env = {**os.environ, **replica_environment(app)}  # the replica's, threads included
    port = free_port()
    if sim:
        cmd = [sys.executable, "-m", "bench.direct_sim", "--config",
               str(Path(config_path).resolve()), "--variant", name, "--port", str(port),
               "--profile", sim[0], "--time-scale", str(sim[1])]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", resolve_model_path(args.model), "--served-model-name",
               args.served_model_name, "--host", "127.0.0.1", "--port", str(port),
               *vllm_flags(args.engine_args)]
    if adapters:
        cmd += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    print(f"[bench] starting vLLM's own server (same args as {name}, nice {nice}): "
          f"{' '.join(cmd[2:])}", flush=True)
    log = open("/tmp/bench-vllm-direct.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(proc, f"{url}/health", what="vLLM's server",
                         log_path="/tmp/bench-vllm-direct.log", timeout_s=300, every_s=2)
    except ServerDidNotStart as e:
        sys.exit(f"[bench] {e}")
    return proc, f"{url}/v1", args.served_model_name, set(adapters)
