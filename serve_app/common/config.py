"""Pydantic schemas for what the Serve config declares about the mesh.

- :class:`VariantArgs`: a variant application's ``args`` (base model and vLLM engine args);
  changing them restarts the variant's replicas.
- :class:`ReplicaConfig`: the ``LLMReplica`` deployment's ``user_config``; applied in place
  by ``reconfigure()``.
- :class:`RouterConfig`: the ``MeshRouter`` deployment's ``user_config`` (routes, weights);
  applied in place by ``reconfigure()``.

Validation errors name the path of the bad field (pydantic's ``loc``); see
:func:`format_validation_error`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serve_app.common.adapters import adapter_key
from serve_app.common.policies import (Admission, RolloutPolicy, ShadowConfig,
                                       Strict)
from serve_app.common.paths import DEFAULT_MODEL_NAME

# Route and application names end up in URLs, metric labels and `route:adapter` model ids.
# Matched whole (pydantic's `pattern`, `re.fullmatch`): `$` alone lets a trailing newline pass.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: Upper bounds of the config's numbers: far above any real setting, and small enough that
#: every figure derived from them per request (token buckets in float, weight sums) is finite.
MAX_WEIGHT = 1_000_000
MAX_CONCURRENT_REQUESTS = 1_000_000
MAX_REQUESTS_PER_MINUTE = 1_000_000_000
MAX_TOKENS_BUDGET = 10**15  # tokens per minute or per day


def check_name(what: str, name: str) -> None:
    """Raise ``ValueError`` unless ``name`` matches :data:`NAME_PATTERN` whole."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(f"{what} {name!r} must match {NAME_PATTERN} (letters, digits, '.', "
                         "'_', '-'; at most 64)")


def duplicates(names: list[str]) -> list[str]:
    """Names that occur more than once, sorted."""
    return sorted({n for n in names if names.count(n) > 1})


def _single_owner(pairs, describe) -> None:
    """Raise ``ValueError(describe(item, first_owner, other_owner))`` if an item of the
    ``(item, owner)`` pairs has two owners."""
    owner: dict[str, str] = {}
    for item, who in pairs:
        if owner.setdefault(item, who) != who:
            raise ValueError(describe(item, owner[item], who))


# ---------------------------------------------------------------------------------------------
# Variant application: args (restart on change) and LLMReplica user_config (in place)
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Router: routes and weights
# ---------------------------------------------------------------------------------------------

def _check_weights(what: str, weighted: list[tuple[str, int]]) -> None:
    """Rules every weighted split shares (route variants, adapter versions)."""
    if dupes := duplicates([arm for arm, _ in weighted]):
        raise ValueError(f"{what} listed twice: {', '.join(dupes)}")
    if sum(w for _, w in weighted) <= 0:
        raise ValueError("weights sum to 0: give at least one a positive weight")


def _check_rollout(what: str, n_arms: int, rollout: RolloutPolicy | None) -> None:
    if rollout is not None and n_arms != 2:
        raise ValueError(f"a rollout needs exactly two {what}s, stable first and canary last; "
                         f"got {n_arms}")


class VariantWeight(Strict):
    """One variant of a route and its integer weight (0: deployed, gets no new traffic)."""

    application: str = Field(pattern=NAME_PATTERN)
    weight: int = Field(ge=0, le=MAX_WEIGHT)


class VersionWeight(Strict):
    """One version of an adapter and its integer weight."""

    version: int = Field(ge=1)
    weight: int = Field(ge=0, le=MAX_WEIGHT)


class AdapterSplit(Strict):
    """An adapter version canary: callers of ``route:<name>`` split between versions.

    Every version listed must be served by a variant of the route (its ``LLMReplica``
    ``user_config.adapters`` lists both). Stable version first, canary last.
    """

    versions: list[VersionWeight] = Field(min_length=1)
    rollout: RolloutPolicy | None = None

    @field_validator("versions")
    @classmethod
    def _weights(cls, v: list[VersionWeight]) -> list[VersionWeight]:
        _check_weights("version", [(f"v{x.version}", x.weight) for x in v])
        return v

    @model_validator(mode="after")
    def _rollout_arms(self) -> AdapterSplit:
        _check_rollout("version", len(self.versions), self.rollout)
        if self.rollout is not None and self.rollout.shadow is not None:
            raise ValueError("rollout.shadow: a shadow phase mirrors a route's variants; an "
                             "adapter version rollout cannot have one")
        return self


class RouteConfig(Strict):
    """A route: the variants a client's ``model`` name maps to, laid out in this order.

    Sticky assignment maps callers onto [0, 1) in variant order, so list the stable variant
    first and the canary last: raising the canary's weight then only moves callers to it.

    Attributes:
        variants: the variant applications and their weights.
        salt: hash salt of the sticky split; defaults to the route name.
        rollout: progressive rollout of the last variant (see :class:`RolloutPolicy`).
        adapters: adapter name -> version split (adapter version canaries).
        admission: bounded queues and priority under load (see :class:`Admission`).
        shadow: mirror a share of the requests to another variant (:class:`ShadowConfig`).
        merged: adapter name -> a variant application whose model has that adapter merged
            into its weights (``scripts/prepare_model.py --merge-adapter``). Requests for the
            adapter go there first, with no LoRA cost, while it runs and holds the version
            the request would get; the route's LoRA variants are the failover. It takes no
            other traffic (it is not one of ``variants``).
        cold_start_timeout_s: longest a request waits for a variant that scaled to zero
            (``autoscaling_config.min_replicas: 0``) to start, s, when no other variant of
            the route runs; 503 ``cold_start_timeout`` with ``Retry-After`` past it. The
            default covers a replica start on a 2-core host (~75 s) with margin.
    """

    variants: list[VariantWeight] = Field(min_length=1)
    salt: str | None = Field(default=None, description="hash salt; defaults to the route name")
    rollout: RolloutPolicy | None = None
    adapters: dict[str, AdapterSplit] = Field(default_factory=dict)
    admission: Admission = Field(default_factory=Admission)
    shadow: ShadowConfig | None = None
    merged: dict[str, str] = Field(default_factory=dict)
    cold_start_timeout_s: float = Field(default=180.0, gt=0, le=1800)

    @field_validator("merged")
    @classmethod
    def _merged_names(cls, v: dict[str, str]) -> dict[str, str]:
        for adapter, app in v.items():
            if "@" in adapter:
                raise ValueError(f"merged: {adapter!r}: name the adapter without a version "
                                 "(the merged variant's model says which version it holds)")
            check_name("merged: adapter name", adapter)
            check_name(f"merged.{adapter}: application", app)
        return v

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: dict[str, AdapterSplit]) -> dict[str, AdapterSplit]:
        for adapter in v:
            check_name("adapters: adapter name", adapter)
        return v

    @field_validator("variants")
    @classmethod
    def _weights(cls, v: list[VariantWeight]) -> list[VariantWeight]:
        _check_weights("variant", [(x.application, x.weight) for x in v])
        return v

    @model_validator(mode="after")
    def _rollout_arms(self) -> RouteConfig:
        _check_rollout("variant", len(self.variants), self.rollout)
        variants = {w.application for w in self.variants}
        if both := sorted(variants & set(self.merged.values())):
            raise ValueError(f"merged: {', '.join(both)} is also one of the route's variants; "
                             "a merged variant serves its adapter only: remove it from "
                             "`variants`")
        if self.shadow is not None and self.rollout is not None and self.rollout.shadow:
            raise ValueError("a route has one shadow at a time: remove `shadow:` while its "
                             "rollout has a shadow phase (rollout.shadow)")
        return self


SHA256_HEX = r"^[0-9a-f]{64}$"


class Tenant(Strict):
    """A caller identity, authenticated by API key (``Authorization: Bearer <key>``).

    Attributes:
        id: tenant name (metrics label, logs).
        api_keys_sha256: SHA-256 hex digests of the tenant's API keys; keys themselves are
            never stored (``meshctl hash-key`` prints a digest).
        admin: may pin a variant with the ``x-mesh-variant`` request header and read
            ``/admin/*``.
        routes: routes the tenant may call; ``["*"]`` for all.
        adapters: adapter names the tenant owns and may call (``route:adapter``).
        max_concurrent_requests: requests in flight at once, across every router replica
            (429 above; :mod:`serve_app.tenancy.limits`).
        requests_per_minute: request rate, across every router replica (429 above).
        tokens_per_minute / tokens_per_day: token budgets (prompt + completion tokens),
            across every router replica: a request reserves its estimated prompt plus its
            ``max_tokens`` at admission and settles with its real usage when it ends (429
            ``tokens_exhausted`` when the reservation does not fit;
            :mod:`serve_app.tenancy.token_budget`).
        limits_fail_mode: what a router does with a limited tenant's request while the
            cluster-wide counts do not answer: ``open`` counts it on that router replica
            alone, within its share of each limit (the limit divided by the router replicas
            running), ``closed`` refuses it (503 ``limits_unavailable`` with
            ``Retry-After``).
        priority: the tenant's priority under contention, in vLLM's convention: lower is
            served first (default 0). It orders the router's admission queues, and reaches
            vLLM as the request ``priority`` on engines with ``scheduling_policy: priority``.
        shadow: false opts the tenant's requests out of shadow traffic (never mirrored).
    """

    id: str = Field(pattern=NAME_PATTERN)
    api_keys_sha256: list[str] = Field(min_length=1)
    admin: bool = False
    routes: list[str] = Field(default_factory=lambda: ["*"])
    adapters: list[str] = Field(default_factory=list)
    max_concurrent_requests: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT_REQUESTS)
    requests_per_minute: int | None = Field(default=None, ge=1, le=MAX_REQUESTS_PER_MINUTE)
    tokens_per_minute: int | None = Field(default=None, ge=1, le=MAX_TOKENS_BUDGET)
    tokens_per_day: int | None = Field(default=None, ge=1, le=MAX_TOKENS_BUDGET)
    limits_fail_mode: Literal["open", "closed"] = "open"
    priority: int = Field(default=0, ge=-1000, le=1000)
    shadow: bool = True

    @field_validator("api_keys_sha256")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        for digest in v:
            if not re.fullmatch(SHA256_HEX, digest):
                raise ValueError(f"{digest[:12]!r}... is not a SHA-256 hex digest (64 lowercase "
                                 "hex characters); store hashes, never keys: meshctl hash-key")
        return v

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: list[str]) -> list[str]:
        for adapter in v:
            check_name("adapter name", adapter)
        return v

    @model_validator(mode="after")
    def _day_holds_a_minute(self) -> Tenant:
        if self.tokens_per_day is not None and self.tokens_per_minute is not None \
                and self.tokens_per_day < self.tokens_per_minute:
            raise ValueError(
                f"tenant {self.id!r}: tokens_per_day ({self.tokens_per_day}) is below "
                f"tokens_per_minute ({self.tokens_per_minute}), so the per-minute budget "
                "could never be used (were they swapped?); set tokens_per_day to at least "
                "tokens_per_minute, or remove tokens_per_minute")
        return self

    def may_call(self, route: str) -> bool:
        return "*" in self.routes or route in self.routes


class ResidentBudget(Strict):
    """A mesh-wide budget of resident variants (``MeshRouter`` ``user_config``
    ``resident_budget``; :mod:`serve_app.variants.resident_budget`).

    Attributes:
        max_variants: most variant applications with a replica (starting, running or
            stopping) at once. A cold start that would pass it first evicts the least
            recently used idle variant whose ``autoscaling_config.policy`` is the
            resident-budget policy (:mod:`serve_app.control.resident_policy`); with none
            idle, 503
            ``resident_budget_full`` with ``Retry-After``.
        evict_timeout_s: longest a cold start waits for the evicted variant to reach zero
            replicas, s; past it, 503 ``resident_budget_full``.
    """

    max_variants: int = Field(ge=1, le=10_000)
    evict_timeout_s: float = Field(default=60.0, gt=0, le=600)


class LedgerConfig(Strict):
    """Where the tenant counts of every router replica are kept (``MeshRouter``
    ``user_config`` ``ledger``; :mod:`serve_app.tenancy.ledger`).

    Attributes:
        backend: ``actor`` (default: a Ray actor that keeps its buckets in the Ray GCS) or
            ``redis`` (a Redis server, which outlives the Ray cluster).
        redis_url: ``redis://host:port/db`` of the server, for ``backend: redis``.
        leases: each router replica holds a lease on each busy tenant's budget and counts
            its requests there, with no ledger call per request (default); false asks the
            ledger for every request of a limited tenant (:mod:`serve_app.tenancy.limits`).
    """

    backend: Literal["actor", "redis"] = "actor"
    redis_url: str | None = None
    leases: bool = True

    @model_validator(mode="after")
    def _url_for_redis(self) -> LedgerConfig:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("ledger.backend redis needs ledger.redis_url, e.g. "
                             "redis://127.0.0.1:6379/0")
        if self.backend == "actor" and self.redis_url:
            raise ValueError(f"ledger.redis_url {self.redis_url!r} is set but ledger.backend "
                             "is actor, which keeps the counts in a Ray actor and would never "
                             "use the server: set backend: redis, or remove redis_url")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://",
                                                              "unix://")):
            raise ValueError(f"ledger.redis_url {self.redis_url!r} is not a Redis URL "
                             "(redis://host:port/db, rediss://..., unix://path)")
        return self


class RouterConfig(Strict):
    """``user_config`` of the ``MeshRouter`` deployment.

    Attributes:
        routes: route name (the OpenAI ``model`` field) -> its variants and weights.
        tenants: who may call; empty means open mode (no auth, logged loudly, no pinning).
        resident_budget: optional budget of resident variants (:class:`ResidentBudget`).
        ledger: where tenant limits are counted (:class:`LedgerConfig`; default the actor).
    """

    routes: dict[str, RouteConfig] = Field(min_length=1)
    tenants: list[Tenant] = Field(default_factory=list)
    resident_budget: ResidentBudget | None = None
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)

    @model_validator(mode="after")
    def _tenants_consistent(self) -> RouterConfig:
        if dupes := duplicates([t.id for t in self.tenants]):
            raise ValueError(f"tenant id listed twice: {', '.join(dupes)}")
        _single_owner(((d, t.id) for t in self.tenants for d in t.api_keys_sha256),
                      lambda d, a, b: f"API key {d[:12]}... belongs to both {a!r} and {b!r}")
        _single_owner(((n, t.id) for t in self.tenants for n in t.adapters),
                      lambda n, a, b: f"adapter {n!r} is owned by both {a!r} and {b!r}; an "
                                      "adapter belongs to one tenant")
        for t in self.tenants:
            for route in t.routes:
                if route != "*" and route not in self.routes:
                    raise ValueError(f"tenant {t.id!r} names unknown route {route!r}")
        return self

    def top_priority(self) -> int:
        """The best (lowest) tenant priority configured; 0 in open mode."""
        return min((t.priority for t in self.tenants), default=0)

    def tenant_by_key_digest(self) -> dict[str, Tenant]:
        """SHA-256 digest of an API key -> its tenant."""
        return {d: t for t in self.tenants for d in t.api_keys_sha256}

    @field_validator("routes")
    @classmethod
    def _route_names(cls, v: dict[str, RouteConfig]) -> dict[str, RouteConfig]:
        for name in v:
            check_name("route name", name)
        return v

    def applications(self) -> set[str]:
        """Every variant application any route names (``variants`` and ``merged``)."""
        return {w.application for r in self.routes.values() for w in r.variants} | {
            a for r in self.routes.values() for a in r.merged.values()}
