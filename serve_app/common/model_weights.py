"""How many bytes of weights a variant's engine reads: the figure its replica's host memory
is sized from (:mod:`serve_app.common.engine_resources`).

Where the figure comes from, the first that answers:

1. the model's files, when they can be read here: a local folder, or a hub or bucket model
   fetched into this node's cache (``cached=True``): the ``total_size`` of its safetensors
   index (``model.safetensors.index.json``), else the sizes of its weight files
   (``*.safetensors``, else ``*.bin`` / ``*.pt``);
2. the model's name: the parameter count it states (``Llama-3.1-8B-Instruct``: 8 billion,
   ``Mixtral-8x7B``: 56, ``SmolLM2-135M``: 0.135) times :data:`BYTES_PER_PARAMETER` of the
   engine's dtype, plus :data:`NAME_MARGIN` (a name rounds its count: Llama 3.1 8B has 8.03
   billion, Qwen2.5 7B 7.6);
3. the model's ``config.json``, when it is here: the parameter count of a decoder-only
   transformer (embeddings, attention with grouped KV heads, gated MLP, experts) from its
   sizes, times the dtype's bytes.

Nothing here touches the network.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

#: Bytes one parameter takes, by the engine's ``dtype`` (or the model's ``torch_dtype`` /
#: ``dtype`` when the engine's is ``auto``).
BYTES_PER_PARAMETER = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
#: Bytes a parameter takes under a weight quantization (``engine_args.quantization``).
QUANTIZED_BYTES = {"fp8": 1, "fbgemm_fp8": 1, "modelopt": 1, "awq": 0.5, "awq_marlin": 0.5,
                   "gptq": 0.5, "gptq_marlin": 0.5, "bitsandbytes": 0.5, "gguf": 0.5}
#: Bytes of a 16-bit parameter when nothing says otherwise (vLLM's ``auto`` on a bf16 model).
DEFAULT_BYTES_PER_PARAMETER = 2
#: What a parameter count read from a name is raised by (the name rounds it down).
NAME_MARGIN = 0.10
#: Weight files, in the order they are looked for.
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")
_INDEX = "model.safetensors.index.json"
#: A parameter count in a name: ``8B``, ``70b``, ``1.5B``, ``135M``, ``8x7B``; not ``A3B``
#: (active parameters) nor part of a longer word.
_COUNT = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BbMm])(?![A-Za-z0-9])")


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights: ``bytes`` (0 when nothing tells) and ``how`` the figure was found,
    for messages (``"the safetensors index of /srv/models/llama"``)."""

    bytes: int
    how: str


def weight_bytes(args, *, cached: bool = True) -> WeightBytes:
    """The bytes of weights a variant's engine reads (see the module docstring).

    Args:
        args: the variant's :class:`~serve_app.common.config.VariantArgs`.
        cached: also read a hub or bucket model's files from this node's cache; False reads
            only a local folder and the name, so the figure is the same on every node that
            has the repository (what the replica's own Ray resources are sized from).
    """
    from serve_app.common.fetch import cached_model
    from serve_app.common.paths import resolve_model_path
    from serve_app.common.sources import parse_source

    source = parse_source(args.model, args.revision)
    folder = None
    if not source.remote:
        try:
            folder = Path(resolve_model_path(source.location))
        except FileNotFoundError:
            folder = None
    elif cached:
        folder = cached_model(args.model, args.revision)
    per_parameter, dtype_how = bytes_per_parameter(args, folder)
    if folder is not None and (found := files_bytes(folder)):
        return found
    if count := parameters_in_name(args.model):
        n = math.ceil(count * (1 + NAME_MARGIN) * per_parameter)
        return WeightBytes(n, f"the name {args.model!r}: {count / 1e9:g} billion parameters "
                              f"+ {NAME_MARGIN:.0%}, x {per_parameter:g} bytes ({dtype_how})")
    if folder is not None and (count := parameters_in_config(folder / "config.json")):
        return WeightBytes(math.ceil(count * per_parameter),
                           f"the config.json of {folder}: {count / 1e9:.2f} billion "
                           f"parameters x {per_parameter:g} bytes ({dtype_how})")
    return WeightBytes(0, f"nothing here tells the size of {args.model!r} (no weights "
                          "fetched on this host, no parameter count such as 8B in its name)")


def files_bytes(folder: Path) -> WeightBytes | None:
    """The weights in a model folder: its safetensors index's ``total_size``, else the sizes
    of its weight files; None when it holds neither."""
    try:
        index = json.loads((folder / _INDEX).read_text())
        total = int(index["metadata"]["total_size"])
        if total > 0:
            return WeightBytes(total, f"the safetensors index of {folder}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for pattern in _WEIGHT_GLOBS:
        files = [p for p in folder.glob(pattern) if p.is_file()]
        if files:
            return WeightBytes(sum(p.stat().st_size for p in files),
                               f"the {pattern} files in {folder}")
    return None


def parameters_in_name(model: str) -> int:
    """The parameter count a model's name states (the last part of its path or id), 0 when
    it states none: ``meta-llama/Llama-3.1-8B-Instruct`` -> 8e9, ``Mixtral-8x7B`` -> 56e9."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    found = 0
    for experts, count, unit in _COUNT.findall(name):
        n = float(count) * (1e9 if unit in "Bb" else 1e6) * (int(experts) if experts else 1)
        found = max(found, int(n))
    return found


def parameters_in_config(path: Path) -> int:
    """The parameters of a decoder-only transformer from its ``config.json`` (its
    ``text_config`` for a multimodal one), 0 when the sizes are not there: embeddings (and an
    untied output layer), per layer the attention projections (grouped KV heads) and a gated
    MLP (times ``num_local_experts`` / ``num_experts`` for a mixture of experts)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(config, dict):
        return 0
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
        vocab = int(text["vocab_size"])
        heads = int(text["num_attention_heads"])
        inner = int(text.get("intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError):
        return 0
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    experts = int(text.get("num_local_experts") or text.get("num_experts") or 1)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * inner * experts
    embeddings = vocab * hidden * (1 if text.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden  # + the final norm


def bytes_per_parameter(args, folder: Path | None = None) -> tuple[float, str]:
    """(bytes a parameter takes, why): the engine's ``quantization``, else its ``dtype``,
    else (``auto``) the model's ``torch_dtype`` from ``folder``'s config.json, else 2."""
    engine = args.engine_args
    quantization = engine.get("quantization")
    if isinstance(quantization, str) and quantization in QUANTIZED_BYTES:
        return QUANTIZED_BYTES[quantization], f"quantization {quantization}"
    dtype = engine.get("dtype")
    if isinstance(dtype, str) and dtype in BYTES_PER_PARAMETER:
        return BYTES_PER_PARAMETER[dtype], f"dtype {dtype}"
    if folder is not None:
        try:
            config = json.loads((folder / "config.json").read_text())
            declared = config.get("torch_dtype") or config.get("dtype")
        except (OSError, ValueError, AttributeError):
            declared = None
        if declared in BYTES_PER_PARAMETER:
            return BYTES_PER_PARAMETER[declared], f"the model's {declared}"
    return DEFAULT_BYTES_PER_PARAMETER, "16-bit"
