#!/usr/bin/env python
"""Many LoRA adapters on a 2-replica variant: ``bench.py --adapters``, 16 adapters unless
--adapters says otherwise (:mod:`bench.adapters`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import adapters  # noqa: E402
from bench.cli import build_parser, main  # noqa: E402
from serve_app.common.script_args import run  # noqa: E402

if __name__ == "__main__":  # the same as bench.py --adapters ...
    argv = sys.argv[1:]
    if "--adapters" not in argv and not any(a.startswith("--adapters=") for a in argv):
        # bench.py --adapters's run, 16 when not given
        argv = ["--adapters", "16", *argv]
    help_text = adapters.__doc__ + "\nOptions are bench.py's; --adapters is 16 when not given."
    run(lambda: main(build_parser(help_text, prog="bench_adapters.py"), argv))
