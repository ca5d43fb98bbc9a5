"""From a variant's ``args`` to its engine: vLLM's config, the engine class, the started engine.

- :func:`engine_config`: vLLM's argument namespace, ``AsyncEngineArgs`` and ``VllmConfig``,
  with every check vLLM makes before it starts an engine (``build_app`` and
  ``meshctl validate`` run it without starting one);
- :func:`engine_cls_for`: the :class:`~serve_app.server.engine_protocol.Engine` class
  ``args.engine`` names (:data:`ENGINE_CLASSES`), resolved once when a replica starts: the
  replica is given its engine, as Ray Serve LLM's ``LLMServer(engine_cls=...)`` is;
- :func:`start_engine`: that class, built and started.
"""

from __future__ import annotations

import importlib
import json

from serve_app.common.config import VariantArgs
from serve_app.common.fetch import model_dir_here
from serve_app.server.engine_protocol import Engine

#: ``args.engine`` -> the import path (``module:Class``) of its :class:`Engine`, imported only
#: when chosen (the simulated engine's modules stay out of a vLLM replica).
ENGINE_CLASSES = {"vllm": "serve_app.server.vllm_engine:VllmEngine",
                  "sim": "serve_app.sim.engine:SimEngine"}


def engine_cls_for(args: VariantArgs) -> type[Engine]:
    """The :class:`Engine` class ``args.engine`` names (:data:`ENGINE_CLASSES`).

    Raises:
        ValueError: an ``engine`` with no class (the message lists those there are).
    """
    path = ENGINE_CLASSES.get(args.engine)
    if path is None:
        raise ValueError(f"args.engine {args.engine!r} has no engine class: use one of "
                         f"{', '.join(sorted(ENGINE_CLASSES))}")
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


async def start_engine(args: VariantArgs) -> Engine:
    """The engine ``args`` ask for (:func:`engine_cls_for`), started: ~30 s on a 2-core CPU
    for vLLM's; seconds for the simulated one (``engine: sim``: no weights).

    Raises:
        ValueError: invalid engine arguments. RuntimeError: the engine failed to start.
    """
    engine = engine_cls_for(args)(args)
    await engine.start()
    return engine


def build_cli_namespace(args: VariantArgs):
    """vLLM's API-server argument namespace with our values set on top of its defaults.

    Mappings (``structured_outputs_config: {backend: guidance}``, ``compilation_config``,
    ...) go through vLLM's own argument parser, as JSON, so they become vLLM's config
    objects; plain values are set as they are.

    Raises:
        ValueError: an ``engine_args`` key that vLLM does not know (the message lists it), or
            a mapping vLLM's parser refuses.
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    known = parser.parse_args([])
    unknown = sorted(k for k in args.engine_args if not hasattr(known, k))
    if unknown:
        raise ValueError(f"unknown vLLM engine_args: {', '.join(unknown)} "
                         "(use AsyncEngineArgs field names, e.g. max_model_len)")
    mappings = {k: v for k, v in args.engine_args.items() if isinstance(v, dict)}
    try:
        ns = parser.parse_args([a for k, v in mappings.items()
                                for a in (f"--{k.replace('_', '-')}", json.dumps(v))])
    except SystemExit:  # argparse exits on a bad value; its message went to stderr
        raise ValueError(f"vLLM refused engine_args {', '.join(mappings)}: "
                         f"{json.dumps(mappings)}") from None
    ns.model = model_dir_here(args.model, args.revision)
    ns.served_model_name = [args.served_model_name]
    for key, value in args.engine_args.items():
        if key not in mappings:
            setattr(ns, key, value)
    if args.gpus_per_replica > 1:  # workers in the replica's placement group, as Ray Serve LLM
        ns.distributed_executor_backend = "ray"
    validate_parsed_serve_args(ns)
    return ns


def engine_config(args: VariantArgs):
    """vLLM's argument namespace, ``AsyncEngineArgs`` and ``VllmConfig`` for ``args``, with
    every check vLLM makes before it starts an engine (model config, ``max_model_len``
    against the model, dtype, scheduler limits, LoRA settings). Takes ~10 s the first time
    in a process (it imports vLLM and reads the model's config), and starts nothing.

    Raises:
        ValueError: an invalid engine argument; the message is vLLM's and names the field
            (pydantic's ``ValidationError`` is a ``ValueError``).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    ns = build_cli_namespace(args)
    engine_args = AsyncEngineArgs.from_cli_args(ns)
    return ns, engine_args, engine_args.create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)
