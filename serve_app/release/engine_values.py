"""vLLM's checks of engine-arg values that run without the whole model and without a GPU, so
``meshctl validate`` can make them wherever the model is (:mod:`serve_app.release.engine_check`).

- :func:`value_problems`, no model at all: each value against the field vLLM declares for it.
  vLLM's server parser files every engine arg under the config class that owns it
  (``--gpu-memory-utilization`` under ``CacheConfig``); that class is a pydantic dataclass
  whose field carries the type, the range and the choices (``gpu_memory_utilization: float =
  Field(gt=0, le=1)``, ``dtype: Literal['auto', 'half', ...] | torch.dtype``), and the value
  is validated against exactly that field. An arg no config class owns is checked against
  its ``EngineArgs`` annotation (``scheduling_policy``); ``quantization`` against vLLM's
  ``QUANTIZATION_METHODS``. A boolean is refused where a number
  is wanted (vLLM would read ``true`` as 1). Mappings (``compilation_config: {...}``) go
  through vLLM's parser, as a replica passes them. Then the sub-configs that need no model
  are built (``LoRAConfig``: ``max_cpu_loras`` >= ``max_loras``, the supported ranks).
- :func:`model_checks`, with the model's config files in a folder (``config.json`` alone
  will do): vLLM's ``ModelConfig`` (dtype against the model, ``max_model_len`` within the
  context it derives) and its ``verify_with_parallel_config`` (attention heads divisible by
  ``tensor_parallel_size``, pipeline parallelism supported by the architecture). Nothing of
  the platform's: that is :func:`serve_app.server.engine.engine_config`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError


@functools.lru_cache(maxsize=1)
def vllm_parser():
    """vLLM's OpenAI server argument parser (``vllm serve``'s), built once."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@functools.lru_cache(maxsize=1)
def field_validators() -> dict[str, Any]:
    """Engine arg name -> a pydantic ``TypeAdapter`` of the field vLLM declares for it."""
    import vllm.config as configs
    from vllm.engine import arg_utils
    from pydantic import TypeAdapter
    from typing import Annotated

    engine_fields = arg_utils.EngineArgs.__dataclass_fields__
    out: dict[str, Any] = {}
    for group in vllm_parser()._action_groups:
        owner = getattr(configs, group.title or "", None)
        fields = getattr(owner, "__pydantic_fields__", {}) if isinstance(owner, type) else {}
        for action in group._group_actions:
            name = action.dest
            info = fields.get(name)
            try:
                if info is not None:
                    kind = (Annotated[(info.annotation, *info.metadata)] if info.metadata
                            else info.annotation)
                    out[name] = TypeAdapter(kind, config=owner.__pydantic_config__)
                elif name in engine_fields:
                    kind = engine_fields[name].type
                    if isinstance(kind, str):
                        kind = eval(kind, vars(arg_utils))  # noqa: S307 -- vLLM's annotation
                    out[name] = TypeAdapter(kind, config={"arbitrary_types_allowed": True})
            except Exception:  # noqa: BLE001 -- a type pydantic cannot check: left to vLLM
                continue
    return out


def value_problems(args) -> list[str]:
    """Problems of a variant's engine-arg values that need no model, as suffixes of
    ``<at>.engine_args``: ``.<key>: vLLM refuses <value>: <vLLM's message>`` (see the
    module docstring). ``args``: a valid :class:`~serve_app.common.config.VariantArgs`
    whose engine-arg names vLLM knows."""
    validators = field_validators()
    problems = []
    for key, value in args.engine_args.items():
        if isinstance(value, dict):
            if message := _mapping_problem(key, value):
                problems.append(f".{key}: vLLM refuses {json.dumps(value)}: {message}")
            continue
        adapter = validators.get(key)
        if adapter is None or value is None:
            continue
        try:
            adapter.validate_python(value, strict=True if isinstance(value, bool) else None)
        except ValidationError as e:
            message = e.errors()[0]["msg"]
            if isinstance(value, bool) and message.startswith("Input should be a valid"):
                message += " (not true or false)"
            problems.append(f".{key}: vLLM refuses {value!r}: {message}")
    quantization = args.engine_args.get("quantization")
    if isinstance(quantization, str):
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        if quantization not in QUANTIZATION_METHODS:
            problems.append(f".quantization: vLLM refuses {quantization!r}: not one of its "
                            f"quantization methods ({', '.join(QUANTIZATION_METHODS)})")
    if problems:
        return problems
    return _subconfig_problems(args)


def _mapping_problem(key: str, value: dict[str, Any]) -> str | None:
    """vLLM's parser's verdict on a mapping engine arg (its JSON form), or None."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            vllm_parser().parse_args([f"--{key.replace('_', '-')}", json.dumps(value)])
    except SystemExit:
        text = stderr.getvalue()
        text = text.split("error: ", 1)[1] if "error: " in text else "vLLM's parser refuses it"
        lines = [ln.strip() for ln in text.splitlines()
                 if ln.strip() and "errors.pydantic.dev" not in ln]
        return " ".join(lines)[:500]
    return None


def _subconfig_problems(args) -> list[str]:
    """The config classes that need no model, built from the args the config sets."""
    from vllm.config import LoRAConfig

    engine = args.engine_args
    if not engine.get("enable_lora"):
        return []
    lora = {k: v for k, v in engine.items() if k in LoRAConfig.__pydantic_fields__}
    if lora.get("max_cpu_loras") is not None and lora["max_cpu_loras"] <= 0:
        lora.pop("max_cpu_loras")  # EngineArgs: a non-positive one means "max_loras"
    try:
        LoRAConfig(**lora)
    except Exception as e:  # noqa: BLE001 -- vLLM's verdict
        return vllm_refusals(args, e)
    return []


def model_checks(args, folder: Path) -> None:
    """vLLM's checks of ``args`` against the model whose config files are in ``folder``
    (see the module docstring).

    Raises:
        ValueError (pydantic's ``ValidationError`` too), NotImplementedError: vLLM's
            refusal, its message naming the field.
    """
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from serve_app.server.engine import build_cli_namespace

    here = args.model_copy(update={"model": str(folder), "revision": None})
    engine_args = AsyncEngineArgs.from_cli_args(build_cli_namespace(here))
    model_config = engine_args.create_model_config()
    parallel = ParallelConfig(tensor_parallel_size=engine_args.tensor_parallel_size,
                              pipeline_parallel_size=engine_args.pipeline_parallel_size,
                              distributed_executor_backend=engine_args
                              .distributed_executor_backend)
    model_config.verify_with_parallel_config(parallel)


def vllm_refusals(args, error: BaseException) -> list[str]:
    """vLLM's refusal ``error`` of ``args``' engine args, as suffixes of
    ``<at>.engine_args``: ``.<key>: vLLM refuses <value>: <message>`` per engine arg it
    names, else ``: vLLM refuses these engine args: <message>``."""
    problems = []
    for field, message in _vllm_messages(error, set(args.engine_args)):
        if field is not None:
            problems.append(f".{field}: vLLM refuses {args.engine_args[field]!r}: {message}")
        else:
            problems.append(f": vLLM refuses these engine args: {message}")
    return problems


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
        by_field.setdefault(field, e["msg"].removeprefix("Value error, "))
    set_fields = {f: m for f, m in by_field.items() if f in keys}
    if set_fields:
        return list(set_fields.items())
    return [(None, f"{f}: {m}") if f else (_named(m, keys), m) for f, m in by_field.items()]


def _named(message: str, keys: set[str]) -> str | None:
    """The engine arg of ``keys`` that ``message`` names first (``tensor_parallel_size``,
    ``tensor parallel size`` or ``--tensor-parallel-size``), or None."""
    import re

    found = []
    for k in keys:
        words = r"[_ -]".join(re.escape(w) for w in k.split("_"))
        if m := re.search(rf"(?<![A-Za-z0-9_]){words}(?![A-Za-z0-9_])", message,
                          re.IGNORECASE):
            found.append((m.start(), k))
    return min(found)[1] if found else None
