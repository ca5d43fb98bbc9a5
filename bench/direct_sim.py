"""vLLM's own OpenAI API server on the simulated engine: the "direct" baseline of
``bench.py --router-throughput``, run as its own process.

The server is vLLM's, whole: its FastAPI app, routes, middleware, request logging, stat
loggers and uvicorn settings (``vllm.entrypoints.launchers.api_server``, which
``vllm.entrypoints.openai.api_server`` re-exports: ``setup_server`` + ``build_and_serve``),
on an engine client we build: vLLM's ``AsyncLLM`` on the simulated engine core
(:func:`serve_app.sim.core.start_sim_async_llm`), from the variant's ``args`` as the mesh's
replica builds it (:func:`serve_app.server.engine.engine_config`). So the mesh and this server
run the same engine front end and core, and only what stands around them differs.

    python -m bench.direct_sim --config serve_configs/tenants.yaml --port 8100 \
        [--variant smollm-v1] [--profile cpu-smollm2] [--time-scale 0.01]

Engines are built under ``if __name__ == "__main__"`` (vLLM starts helper processes).
"""

from __future__ import annotations

import argparse

#: The simulated engine of the mesh's variants in ``bench.py --router-throughput``: this
#: host's fitted profile, every duration x 0.01 (an engine that costs ~nothing).
PROFILE, TIME_SCALE = "cpu-smollm2", 0.01


def variant_args(config_path: str, variant: str | None, profile: str, time_scale: float):
    """The ``VariantArgs`` of ``variant`` (None: the config's first) of the Serve config at
    ``config_path``, on the simulated engine (``profile``, ``time_scale``, no start delay):
    what :func:`serve_app.common.serve_configs.on_sim_engine` gives the mesh's variants.

    Raises:
        ValueError: no such variant, or invalid ``args``.
    """
    from serve_app.common.config import VariantArgs
    from serve_app.common.serve_configs import load_yaml, mesh_parts, on_sim_engine

    cfg = on_sim_engine(load_yaml(config_path), profile=profile, time_scale=time_scale,
                        start_s=0)
    return VariantArgs.model_validate(mesh_parts(cfg).variant(variant).get("args") or {})


async def serve(args, host: str, port: int) -> None:
    """Serve ``args`` (a ``VariantArgs`` with ``engine: sim``) with vLLM's own API server on
    ``host``:``port`` until the process is told to stop."""
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve
    from vllm.entrypoints.launchers.launcher import setup_server

    from serve_app.server.engine import engine_config
    from serve_app.sim.core import start_sim_async_llm

    ns, _, vllm_config = engine_config(args)
    ns.host, ns.port = host, port
    listen_address, sock = setup_server(ns, reuse_port=False)
    engine = await start_sim_async_llm(args, vllm_config)  # vLLM's default stat loggers
    try:
        await (await build_and_serve(engine, listen_address, sock, ns))
    finally:
        sock.close()
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the mesh's Serve config")
    parser.add_argument("--variant", help="variant application (default: the config's first)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--profile", default=PROFILE)
    parser.add_argument("--time-scale", type=float, default=TIME_SCALE)
    a = parser.parse_args(argv)
    import uvloop  # as vLLM's own entry point runs its server

    uvloop.run(serve(variant_args(a.config, a.variant, a.profile, a.time_scale),
                     a.host, a.port))


if __name__ == "__main__":
    main()
