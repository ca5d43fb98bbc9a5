#!/usr/bin/env python
"""The mesh at scale, by simulation: ``bench.py --sim``, h100-llama3-8b unless --sim says
otherwise (:mod:`bench.scale`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import scale  # noqa: E402
from bench.cli import build_parser, main  # noqa: E402
from serve_app.common.script_args import run  # noqa: E402

if __name__ == "__main__":  # the same as bench.py --sim ...
    argv = sys.argv[1:]
    if "--sim" not in argv and not any(a.startswith("--sim=") for a in argv):
        # bench.py --sim's run, h100-llama3-8b when not given
        argv = ["--sim", "h100-llama3-8b", *argv]
    help_text = scale.__doc__ + "\nOptions are bench.py's; --sim is h100-llama3-8b when not given."
    run(lambda: main(build_parser(help_text, prog="bench_scale.py"), argv))
