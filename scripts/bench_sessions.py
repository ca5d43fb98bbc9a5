#!/usr/bin/env python
"""Cache-aware replica routing against Serve's default router: ``bench.py --sessions``, 24
sessions unless --sessions says otherwise (:mod:`bench.sessions`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import sessions  # noqa: E402
from bench.cli import build_parser, main  # noqa: E402
from serve_app.common.script_args import run  # noqa: E402

if __name__ == "__main__":  # the same as bench.py --sessions ...
    argv = sys.argv[1:]
    if "--sessions" not in argv and not any(a.startswith("--sessions=") for a in argv):
        # bench.py --sessions's run, 24 when not given
        argv = ["--sessions", "24", *argv]
    help_text = sessions.__doc__ + "\nOptions are bench.py's; --sessions is 24 when not given."
    run(lambda: main(build_parser(help_text, prog="bench_sessions.py"), argv))
