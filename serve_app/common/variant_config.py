"""Pydantic schemas of a variant application (``import_path: serve_app.replica:build_app``).

- :class:`VariantArgs` (with :class:`SimArgs`): its ``args`` (base model and vLLM engine
  args); changing them restarts the variant's replicas.
- :class:`ReplicaConfig` (with :class:`AdapterRef`, :class:`FaultInjection`): the
  ``LLMReplica`` deployment's ``user_config``; applied in place by ``reconfigure()``.

Validation errors name the path of the bad field (pydantic's ``loc``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serve_app.common.adapters import adapter_key
from serve_app.common.config_rules import NAME_PATTERN, duplicates
from serve_app.common.paths import DEFAULT_MODEL_NAME
from serve_app.common.policies import Strict


class SimArgs(Strict):
    """``args.sim`` of a variant on the simulated engine (``engine: sim``; tests and scale
    benchmarks only, never a shipped config: :mod:`serve_app.sim`).

    Attributes:
        profile: the cost model, a file in ``serve_app/sim/profiles/`` by name.
        start_s: seconds the engine takes to start (None: the profile's ``engine_start_s``);
            a long one stands for an engine that hangs at start.
        fail_start: when set, the engine fails to start with this reason (drills).
        reconfigure_s: seconds every ``reconfigure()`` of the replica takes before it applies
            the new ``user_config`` (Serve shows the replica UPDATING meanwhile): in-place
            change drills with a slow reconfigure.
        time_scale: every duration of the profile times this (its prefill rate divided by
            it): 0.25 runs this host's fitted profile four times faster, with the same
            answers and the same order of events (:meth:`SimProfile.scaled`). ``start_s``
            and ``reconfigure_s`` are not scaled.
    """

    profile: str = "cpu-smollm2"
    start_s: float | None = Field(default=None, ge=0, le=86_400)
    fail_start: str | None = None
    reconfigure_s: float = Field(default=0.0, ge=0, le=60)
    time_scale: float = Field(default=1.0, gt=0, le=10)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        from serve_app.common.sim_profile import load_profile

        load_profile(v)  # raises ValueError naming the shipped profiles
        return v


class VariantArgs(Strict):
    """``args`` of a variant application (``import_path: serve_app.replica:build_app``).

    Attributes:
        model: where the weights come from (:mod:`serve_app.common.sources`): a model folder's
            name under ``$MESH_MODELS_DIR`` (default ``models/``) or a path; a Hugging Face
            id (``org/name``, ``hf://org/name``) with ``revision``; or a bucket folder
            (``s3://bucket/prefix``, ``gs://bucket/prefix``). A remote one is fetched into the
            node's cache when a replica starts (:mod:`serve_app.common.fetch`).
        revision: the hub commit (40 hex) a Hugging Face id is pinned to; nothing else has one.
        served_model_name: the name vLLM serves the base model under; must equal the route
            name that sends traffic here, so responses carry the route name as ``model``.
        engine_args: vLLM engine arguments by their ``AsyncEngineArgs`` names (``dtype``,
            ``max_model_len``, ``max_num_seqs``, ``enforce_eager``, ``enable_lora``,
            ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, ...).
        engine: ``vllm`` (the default: a real vLLM engine) or ``sim``: vLLM's own front end
            on a simulated engine core whose time follows a profile (tests and scale
            benchmarks; ``meshctl validate`` flags it).
        sim: the simulated engine's settings (only with ``engine: sim``).
        accelerator_type: the GPU the variant's replicas need, by Ray's name for it (``H100``,
            ``A100-80G``, ``L4``: :func:`gpu_accelerator_types`), as Ray Serve LLM's
            ``LLMConfig.accelerator_type``. It makes the variant a GPU variant (a replica on
            one GPU gets one without ``ray_actor_options``), Ray places its replicas only on
            nodes of that type (each GPU bundle and the actor ask for a share of Ray's
            ``accelerator_type:<type>`` resource), and ``meshctl kuberay`` gives their pods
            the node selector the fleet file names for it.
    """

    revision: str | None = None  # before model: the model's check reads it
    model: str = DEFAULT_MODEL_NAME
    served_model_name: str = Field(pattern=NAME_PATTERN)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    engine: Literal["vllm", "sim"] = "vllm"
    sim: SimArgs | None = None
    accelerator_type: str | None = None

    @field_validator("accelerator_type")
    @classmethod
    def _known_accelerator(cls, v: str | None) -> str | None:
        if v is not None and v not in gpu_accelerator_types():
            import difflib

            close = difflib.get_close_matches(v, gpu_accelerator_types(), n=1, cutoff=0.6)
            raise ValueError(
                f"accelerator_type {v!r} is not a GPU type Ray knows; "
                + (f"did you mean {close[0]!r}? " if close else "")
                + f"use one of {', '.join(gpu_accelerator_types())} (Ray's names, "
                  "ray.util.accelerators), or remove it")
        return v

    @model_validator(mode="after")
    def _sim_settings_need_sim(self) -> "VariantArgs":
        if self.sim is not None and self.engine != "sim":
            raise ValueError("args.sim is for the simulated engine: set engine: sim, "
                             "or remove sim")
        return self

    @field_validator("model")
    @classmethod
    def _model_source(cls, v: str, info: ValidationInfo) -> str:
        from serve_app.common.sources import source_problem

        if problem := source_problem(v, info.data.get("revision")):
            raise PydanticCustomError("model_source", "{problem}", {"problem": problem})
        return v

    @model_validator(mode="after")
    def _parallelism(self) -> "VariantArgs":
        backend = self.engine_args.get("distributed_executor_backend")
        if self.gpus_per_replica > 1 and backend not in (None, "ray"):
            raise ValueError(
                f"engine_args.distributed_executor_backend {backend!r}: a replica that spans "
                f"{self.gpus_per_replica} GPUs (tensor_parallel_size x pipeline_parallel_size) "
                "runs vLLM's workers in its Ray placement group: use 'ray' (the default then)")
        return self

    @property
    def gpus_per_replica(self) -> int:
        """``tensor_parallel_size`` x ``pipeline_parallel_size``: the GPUs one replica's
        engine spans (1 for a replica on one GPU or on CPUs)."""
        return (int(self.engine_args.get("tensor_parallel_size") or 1)
                * int(self.engine_args.get("pipeline_parallel_size") or 1))

    @field_validator("engine_args")
    @classmethod
    def _no_model_in_engine_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "served_model_name", "revision"):
            if key in v:
                raise ValueError(f"set {key!r} at the top level of args, not in engine_args")
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if key in v and (not isinstance(v[key], int) or isinstance(v[key], bool)
                             or v[key] < 1):
                raise ValueError(f"engine_args.{key} must be a whole number >= 1, "
                                 f"got {v[key]!r}")
        return v


def gpu_accelerator_types() -> list[str]:
    """The ``accelerator_type`` values a variant may name: the NVIDIA GPU types Ray knows
    (``ray.util.accelerators``; Ray detects a node's type and gives the node 1 of resource
    ``accelerator_type:<type>``). The GPU lock is a CUDA build, so only NVIDIA's."""
    import ray.util.accelerators.accelerators as known

    return [v for k, v in vars(known).items() if k.startswith("NVIDIA_")]


class AdapterRef(Strict):
    """An adapter version a variant serves, looked up in the adapter registry."""

    name: str = Field(pattern=NAME_PATTERN)
    version: int = Field(ge=1)

    @property
    def key(self) -> str:
        """``name@vN``."""
        return adapter_key(self.name, self.version)


class FaultInjection(Strict):
    """FOR TESTS AND DRILLS ONLY: make a share of a variant's requests fail or slow down, so a
    rollback can be exercised on a real deployment. Leave unset in production.

    Attributes:
        error_rate: share of requests (0..1) that fail as a variant failure (503
            ``injected_fault`` once failover finds no other variant).
        delay_rate: share of requests (0..1) held ``delay_ms`` before generation starts.
        delay_ms: the added delay, ms.
    """

    error_rate: float = Field(default=0.0, ge=0, le=1)
    delay_rate: float = Field(default=0.0, ge=0, le=1)
    delay_ms: int = Field(default=0, ge=0, le=600_000)


class ReplicaConfig(Strict):
    """``user_config`` of the ``LLMReplica`` deployment, applied by ``reconfigure()``.

    Attributes:
        system_prompt: default system message added to chat requests that carry none
            (variants of one route can differ here, visibly, for canary tests).
        adapters: LoRA adapters to serve (see :mod:`serve_app.server.lora`). Usually one version
            per name (a new version replaces the old one); two versions of a name serve an
            adapter version canary, split by the router's ``routes.<route>.adapters``.
        adapters_manifest: the adapter registry file; default ``adapters/manifest.yaml``. A
            bucket object (``s3://bucket/key``, ``gs://bucket/key``) or a hub file
            (``hf://org/name@<commit>/path``), fetched by each replica into its node's cache,
            the same file everywhere; an absolute path, on every node; a relative path, from
            the config file's folder under ``meshctl`` (it deploys the absolute path), from
            the repository root under plain ``serve deploy``
            (:func:`~serve_app.common.adapters.manifest_file`).
        max_adapters_per_replica: adapter versions a replica keeps loaded (resident); the rest
            of the declared ones load on first use, evicting the least recently used idle one.
            Default (None): the engine's ``max_cpu_loras``, which is also its ceiling.
        fault_injection: testing only, see :class:`FaultInjection`.
        stream_batching_interval_ms: a stream sends its first chunk at once, then at most one
            message per this many ms with everything that arrived meanwhile (fewer messages
            across the replica -> router -> proxy hops; 0: one message per chunk), as Ray
            Serve LLM's ``stream_batching_interval_ms``.
    """

    system_prompt: str | None = None
    stream_batching_interval_ms: int = Field(default=100, ge=0, le=1000)
    adapters: list[AdapterRef] = Field(default_factory=list)
    adapters_manifest: str | None = None
    max_adapters_per_replica: int | None = Field(default=None, ge=1, le=4096)
    fault_injection: FaultInjection | None = None

    @field_validator("adapters_manifest")
    @classmethod
    def _manifest_source(cls, v: str | None) -> str | None:
        from serve_app.common.sources import SourceError, parse_file_source

        try:
            if v is not None:
                parse_file_source(v)
        except SourceError as e:
            raise PydanticCustomError("manifest_source", "{problem}", {"problem": str(e)})
        return v

    @field_validator("adapters")
    @classmethod
    def _each_version_once(cls, v: list[AdapterRef]) -> list[AdapterRef]:
        if dupes := duplicates([a.key for a in v]):
            raise ValueError(f"adapter version listed twice: {', '.join(dupes)}")
        return v

