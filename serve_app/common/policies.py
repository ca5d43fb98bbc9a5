"""Policies a route declares in the router's ``user_config``: how it admits requests under
load, how a canary is rolled out, and how a variant is shadowed. Pure schemas (pydantic)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    """A config schema: unknown fields refused, frozen, and no ``inf`` or ``nan`` in any
    number (``.inf`` in YAML would pass every ``ge=`` bound). A refused value is not echoed
    in the error's text (a model URI may carry a credential that Serve would log with it);
    :func:`~serve_app.common.errors.format_validation_error` says what was wrong."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,
                              hide_input_in_errors=True)


class Admission(Strict):
    """How a route's variants admit requests under load (see :mod:`serve_app.admission.variant_queue`).

    Attributes:
        queue_timeout_s: longest a request waits for a slot, s; a request that cannot start
            within it gets 503 with ``Retry-After``, at arrival when its estimated wait is
            already longer.
        reserved_slots: slots of each variant only the best tenant priority may take, so its
            requests start at once while worse ones fill the variant (0: none).
        max_queued_per_slot: a fixed bound on the requests that may wait for one variant,
            per slot (its engines' ``max_num_seqs`` in all); 503 beyond. Default (None): no
            fixed bound, the queue holds what can start within ``queue_timeout_s`` at the
            variant's service time under load.
        fairness: the order among queued requests of one priority: ``tokens`` serves the
            tenant with the least recent service first (weighted prompt and completion
            tokens, the VTC scheduler's idea), ``fifo`` in arrival order.
        newcomer_slots: engine slots of each variant that a busy tenant (one holding an
            equal share of the slots or more) may not take, so a request of another tenant
            (nothing in flight, or fewer than its share) starts at once (with ``fairness:
            tokens``; 0: none). A count over the variant's replicas, not a
            share: keep about twice the newcomers' requests in flight (docs/scale.md,
            "Tenants", shows what each size costs and buys).
        anticipation_s: how long the slot a tenant's request frees stays its own, s, when
            that tenant would be served next (less service than the tenants waiting; with
            ``fairness: tokens``): a client that sends its next request when the last one ends keeps
            its share instead of losing each slot to the queue in the moment between the
            two (anticipatory scheduling; 0: off).
        headroom: requests the best priority may have in flight beyond the engines'
            ``max_num_seqs``, as a share of it: they wait inside vLLM (in its priority
            order), so an engine slot freed by a finished request is taken at once instead
            of after the router's next dispatch. Raise it for an engine that finishes
            requests faster than the mesh turns a slot round; past the mesh's own order
            (fair share, newcomer slots) those requests are vLLM's to order.
    """

    queue_timeout_s: float = Field(default=30.0, gt=0, le=600)
    reserved_slots: int = Field(default=1, ge=0, le=100_000)
    max_queued_per_slot: float | None = Field(default=None, ge=0, le=10_000)
    fairness: Literal["tokens", "fifo"] = "tokens"
    newcomer_slots: int = Field(default=1, ge=0, le=100_000)
    anticipation_s: float = Field(default=0.05, ge=0, le=5)
    headroom: float = Field(default=0.25, ge=0, le=10)


class RolloutGates(Strict):
    """What the canary must stay within, compared with the stable arm, to advance.

    Figures come from the router's own observations of each request (the same ones behind
    the ``mesh_*`` metrics): the canary's over the current step, the stable arm's over the
    whole rollout. ``None`` switches a ratio gate off.

    Attributes:
        max_error_rate_increase: canary error rate minus stable error rate (fractions; an
            error is a variant failure: failing before its first byte, or a stream cut
            short; request errors (4xx) and internal errors (500) do not count).
        max_ttft_p95_ratio: canary / stable time-to-first-token p95 (streamed requests).
        max_latency_p95_ratio: canary / stable end-to-end latency p95.
        max_truncated_streams: canary streams cut short in one step.
    """

    max_error_rate_increase: float = Field(default=0.02, ge=0, le=1)
    max_ttft_p95_ratio: float | None = Field(default=1.5, gt=0, le=1000)
    max_latency_p95_ratio: float | None = Field(default=1.5, gt=0, le=1000)
    max_truncated_streams: int = Field(default=0, ge=0, le=1_000_000)


class ShadowConfig(Strict):
    """Mirror a share of a route's requests to another variant, compare the answers, and
    never let the mirror touch the client (see :mod:`serve_app.control.shadow_mirror`).

    Attributes:
        application: the shadow variant (a variant application that serves the route).
        percent: share of callers mirrored, 0..100 (sticky per caller, like splits).
        max_in_flight: mirrored requests running at once per router replica; more are
            dropped (and counted).
        keep_samples: keep the last N disagreeing pairs (prompt and both answers) for
            ``GET /admin/shadows``; 0 (default) keeps no prompt or answer.
    """

    application: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    percent: float = Field(default=100, ge=0, le=100)
    max_in_flight: int = Field(default=4, ge=1, le=100_000)
    keep_samples: int = Field(default=0, ge=0, le=1000)


class ShadowPhase(Strict):
    """A rollout's first phase: the canary only shadows the stable arm (weight 0) until it
    has ``min_requests`` comparisons, then its gates decide: pass, and the weight steps
    start; fail, and it is rolled back before it served anyone.

    Attributes:
        percent: share of callers mirrored to the canary meanwhile.
        max_in_flight: mirrored requests at once per router replica.
        min_requests: comparisons before a verdict.
        min_agreement: least share of exact matches (greedy requests agree exactly).
        min_similarity: least mean similarity of the answers, 0..1.
        max_error_rate: most share of mirrored requests the canary failed.
        max_latency_ratio: most canary / stable latency (median of the pairs); None: off.
    """

    percent: float = Field(default=100, ge=0, le=100)
    max_in_flight: int = Field(default=4, ge=1, le=100_000)
    min_requests: int = Field(default=20, ge=1, le=1_000_000)
    min_agreement: float = Field(default=0.8, ge=0, le=1)
    min_similarity: float = Field(default=0.9, ge=0, le=1)
    max_error_rate: float = Field(default=0.05, ge=0, le=1)
    max_latency_ratio: float | None = Field(default=2.0, gt=0, le=1000)


class RolloutPolicy(Strict):
    """A progressive rollout of a split's canary (its last arm) against its stable (first) arm.

    The mesh sets the canary's weight to each step in turn (stable gets the rest). A step
    passes when the canary has ``min_requests`` requests in it, ``min_step_s`` has passed and
    every gate holds; after the last step the canary is promoted (weight 100). A gate that
    fails once the canary has ``min_requests`` requests rolls it back (weight 0) at once.
    While a rollout is on, it owns the split's weights; the configured ones are ignored.

    Attributes:
        id: the rollout's name; deploy a new one to restart from the first step.
        steps: canary weights in percent, strictly increasing, in 1..100.
        min_requests: canary requests per step before a verdict.
        min_step_s: seconds each step lasts at least.
        gates: see :class:`RolloutGates`.
        paused: hold the current step (no verdicts) until a deploy sets it false again.
        abort: roll back now (canary weight 0) and stop.
        shadow: start with a shadow phase (see :class:`ShadowPhase`); route rollouts only.
    """

    id: str = Field(default="1", min_length=1, max_length=64)
    steps: list[int] = Field(default_factory=lambda: [5, 25, 50, 100], min_length=1)
    min_requests: int = Field(default=20, ge=1, le=1_000_000)
    min_step_s: float = Field(default=60, ge=0, le=7 * 86_400)
    gates: RolloutGates = Field(default_factory=RolloutGates)
    paused: bool = False
    abort: bool = False
    shadow: ShadowPhase | None = None

    @field_validator("steps")
    @classmethod
    def _increasing_percentages(cls, v: list[int]) -> list[int]:
        if any(not 1 <= x <= 100 for x in v) or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"steps {v} must be strictly increasing percentages in 1..100, "
                             "e.g. [5, 25, 50, 100]")
        return v


