#!/usr/bin/env python
"""What the mesh costs per request against vLLM's own server on the same simulated engine:
``bench.py --router-throughput`` (:mod:`bench.router_throughput`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import router_throughput  # noqa: E402
from bench.cli import build_parser, main  # noqa: E402
from serve_app.common.script_args import run  # noqa: E402

if __name__ == "__main__":  # the same as bench.py --router-throughput ...
    run(lambda: main(build_parser(router_throughput.__doc__ + "\nOptions are bench.py's.",
                                  prog="bench_router.py"), ["--router-throughput", *sys.argv[1:]]))
