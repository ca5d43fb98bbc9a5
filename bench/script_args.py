"""What every command of the repository around the product shares on its command line (the
scripts of ``scripts/``, ``dashboards/build.py``, ``scripts/stop.sh`` and
``scripts/observability.sh``): ``--help`` that shows each option's default, and one line of
error with exit status 2, never a traceback, for bad arguments, files that cannot be read and
addresses that do not answer (as ``meshctl``).

    parser = script_parser(__doc__)
    ...
    if __name__ == "__main__":
        run(main)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

#: Exit status of a script that cannot run as asked (argparse's own for bad arguments).
USAGE_EXIT = 2


class ScriptError(Exception):
    """A script cannot run as asked; the message is one line that says how to fix it."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (but for a flag, or none: the help says what
    then happens); the description as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):
            return action.help or ""
        return super()._get_help_string(action)


class ScriptParser(argparse.ArgumentParser):
    """argparse with defaults in ``--help`` and a one-line error for bad arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: {message} (see {self.prog} --help)\n")


def script_parser(doc: str | None, *, prog: str | None = None) -> ScriptParser:
    """A :class:`ScriptParser` whose description is the script's docstring."""
    return ScriptParser(prog=prog or os.path.basename(sys.argv[0]), description=doc)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(getattr(e, "strerror", None) or e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def run(main: Callable[[], Any]) -> NoReturn:
    """Run a script's ``main()`` and exit with its return value (None: 0). A
    :class:`ScriptError`, or a file, address or value the script could not use (``OSError``,
    ``ValueError``, httpx's errors), ends it with one line on stderr and exit status 2;
    Ctrl-C with 130."""
    import httpx

    prog = os.path.basename(sys.argv[0])
    try:
        code = main()
    except ScriptError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    except (OSError, ValueError, httpx.HTTPError) as e:
        where = getattr(e, "filename", None)  # an OSError's file
        print(f"{prog}: {_one_line(e)}" + (f": {where}" if where else ""), file=sys.stderr)
        sys.exit(USAGE_EXIT)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
