"""Mesh metrics, exported through Ray's metrics API so they add up across router replicas.

Ray exposes them in Prometheus format on every node's metrics export port
(``ray start --metrics-export-port=8080``); Prometheus finds the ports through
``/tmp/ray/prom_metrics_service_discovery.json`` (Ray docs, "Collecting and monitoring
metrics"). Names get Ray's ``ray_`` prefix, e.g. ``ray_mesh_requests_total``.

Labels: ``route``, ``variant`` (the application that served; empty when the router refused
the request itself), ``tenant`` (empty in open mode), ``adapter`` (empty for the base model),
``status`` (HTTP status) on requests. Every label value comes from the config (routes,
variants, tenants, adapters a tenant owns or a variant serves); a name a client made up is
counted as ``unknown`` (:meth:`serve_app.request.planner.RequestPlanner.labels`), so clients
cannot grow the number of series. The replicas add ``mesh_adapter_events`` (``variant``,
``adapter`` as ``name@vN``, ``event``: one of :data:`serve_app.server.lora.EVENTS`),
``mesh_adapter_load_seconds``, ``mesh_adapters_resident`` (``variant``, ``replica``;
:class:`serve_app.replica.AdapterMetrics`) and vLLM's own engine series
(:mod:`serve_app.observability.engine_metrics`).
"""

from __future__ import annotations

import time

from ray.util.metrics import Counter, Gauge, Histogram

TAGS = ("route", "variant", "tenant", "adapter")
SHADOW_TAGS = ("route", "shadow")
_SECONDS = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300]
_START_SECONDS = [5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600]
#: States of a variant that scales to zero (:meth:`VariantAvailability.state`).
VARIANT_STATES = ("warm", "starting", "zero", "failed")
_RATIOS = [0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]
_ITL_SECONDS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2]


class MeshMetrics:
    """The router's metrics; create one per router replica."""

    def __init__(self) -> None:
        self.cold_starts = Counter("mesh_cold_starts", "Cold starts of variants that scale to "
                                   "zero, by outcome: started, failed, budget_full.",
                                   tag_keys=("variant", "outcome"))
        self.cold_start_seconds = Histogram("mesh_cold_start_seconds", "Time from waking a "
                                            "variant at zero replicas to its first answer, s.",
                                            boundaries=_START_SECONDS, tag_keys=("variant",))
        self.cold_start_held = Counter("mesh_cold_start_held_requests", "Requests held for a "
                                       "cold start, by outcome: served (went on to "
                                       "admission), timed_out, failed, budget_full, "
                                       "client_left.",
                                       tag_keys=("route", "variant", "outcome"))
        self.cold_start_wait_seconds = Histogram("mesh_cold_start_wait_seconds", "Time a "
                                                 "request was held for a cold start, s.",
                                                 boundaries=_START_SECONDS,
                                                 tag_keys=("route", "variant"))
        self.evictions = Counter("mesh_resident_evictions", "Variants the resident budget "
                                 "evicted to make room for a cold start, by outcome: stopped "
                                 "(reached zero replicas), timed_out.",
                                 tag_keys=("variant", "outcome"))
        self._remaining: dict[str, tuple[int, int, float, float]] = {}
        self.tokens_remaining = Gauge("mesh_tenant_tokens_remaining", "Tokens left in the "
                                      "tenant's budget (tokens_per_minute, else "
                                      "tokens_per_day) after its last admitted request's "
                                      "reservation.", tag_keys=("tenant",))
        self.variant_state = Gauge("mesh_variant_state", "1 for the state a variant that "
                                   "scales to zero is in (warm, starting, zero), else 0.",
                                   tag_keys=("variant", "state"))
        self.requests = Counter("mesh_requests", "Requests by final HTTP status.",
                                tag_keys=TAGS + ("status",))
        self.errors = Counter("mesh_errors", "Failed requests (status >= 400 or a stream cut "
                              "short), by kind.", tag_keys=TAGS + ("kind",))
        self.ttft = Histogram("mesh_time_to_first_token_seconds", "Time to the first streamed "
                              "chunk, s.", boundaries=_SECONDS, tag_keys=TAGS)
        self.latency = Histogram("mesh_request_latency_seconds", "End-to-end request latency, s.",
                                 boundaries=_SECONDS, tag_keys=TAGS)
        self.prompt_tokens = Counter("mesh_prompt_tokens", "Prompt tokens.", tag_keys=TAGS)
        self.completion_tokens = Counter("mesh_completion_tokens", "Completion tokens.",
                                         tag_keys=TAGS)
        self.itl = Histogram("mesh_inter_token_latency_seconds", "Mean time between tokens of "
                             "a stream, as the client saw it, s.", boundaries=_ITL_SECONDS,
                             tag_keys=TAGS)
        self.queue_time = Histogram("mesh_queue_time_seconds", "Time a request waited for a "
                                    "slot of its variant (admission), s.",
                                    boundaries=_SECONDS, tag_keys=TAGS)
        self.rejected = Counter("mesh_rejected", "Requests the mesh refused before running "
                                "them, by reason (the error code: overloaded, queue_timeout, "
                                "shed, no_healthy_variant, invalid_api_key, "
                                "concurrency_limit_exceeded, ...).", tag_keys=TAGS + ("reason",))
        self.failovers = Counter("mesh_failovers", "Variants that failed before the first byte "
                                 "and were skipped.", tag_keys=("route", "variant"))
        self.shadow_requests = Counter("mesh_shadow_requests", "Mirrored requests by outcome: "
                                       "compared, shadow_error, dropped (max_in_flight, or asleep), "
                                       "primary_failed.", tag_keys=SHADOW_TAGS + ("outcome",))
        self.shadow_exact = Counter("mesh_shadow_exact_matches", "Mirrored pairs whose texts "
                                    "are equal.", tag_keys=SHADOW_TAGS)
        self.shadow_similarity = Histogram("mesh_shadow_similarity", "Similarity of mirrored "
                                           "pairs, 0..1 (rapidfuzz ratio).",
                                           boundaries=_RATIOS, tag_keys=SHADOW_TAGS)
        self.shadow_latency_ratio = Histogram("mesh_shadow_latency_ratio", "Shadow / primary "
                                              "latency of mirrored pairs.",
                                              boundaries=[0.5, 0.75, 0.9, 1, 1.1, 1.25, 1.5, 2,
                                                          3, 5, 10], tag_keys=SHADOW_TAGS)
        self.config_rejected = Counter("mesh_config_rejected", "Invalid router user_configs "
                                       "ignored by reconfigure().")
        self.tokens_reserved = Counter("mesh_tenant_tokens_reserved", "Tokens reserved at "
                                       "admission by tenants with token budgets (prompt "
                                       "estimate + max_tokens).", tag_keys=("tenant",))
        self.tokens_used = Counter("mesh_tenant_tokens_used", "Tokens the same requests cost "
                                   "when they ended (what their budgets were settled with).",
                                   tag_keys=("tenant",))

    def record(self, tags: dict[str, str], status: int, latency_s: float, *,
               ttft_s: float | None = None, prompt_tokens: int = 0, completion_tokens: int = 0,
               error_kind: str | None = None) -> None:
        """Account for one finished request (``tags``: route, variant, tenant, adapter).
        The inter-token latency of a stream is ``(latency - ttft) / (completion_tokens - 1)``."""
        self.requests.inc(1, {**tags, "status": str(status)})
        self.latency.observe(latency_s, tags)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags)
            if completion_tokens > 1 and error_kind is None:
                self.itl.observe((latency_s - ttft_s) / (completion_tokens - 1), tags)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens, tags)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens, tags)
        if error_kind is None and status >= 400:
            error_kind = f"http_{status}"
        if error_kind:
            self.errors.inc(1, {**tags, "kind": error_kind})

    def record_tokens_remaining(self, tenant: str, quota_tokens: tuple[int, int, float]
                                ) -> None:
        """A tenant's token quota after an admission: ``(limit, remaining, seconds until
        full)`` (:class:`~serve_app.tenancy.quota.Quota`). Set now, and again by
        :meth:`refresh_gauges` with the window's refill since (Ray drops a gauge value that
        is not set for a while, and a quiet tenant's budget refills)."""
        self._remaining[tenant] = (*quota_tokens, time.monotonic())
        self.tokens_remaining.set(quota_tokens[1], {"tenant": tenant})

    def refresh_gauges(self, variant_states: dict[str, dict]) -> None:
        """Set the router's gauges, on every availability poll (Ray drops a gauge value that
        is not set for a while): ``mesh_variant_state`` from ``variant_states``
        (:meth:`VariantAvailability.states`), and the token-remaining ones, each refilled
        linearly toward its limit over its seconds-until-full since it was recorded (what
        this router knows; other routers' use since is not in it)."""
        for variant, s in variant_states.items():
            for state in VARIANT_STATES:
                self.variant_state.set(float(s["state"] == state),
                                       {"variant": variant, "state": state})
        now = time.monotonic()
        for tenant, (limit, remaining, full_in_s, at) in self._remaining.items():
            refilled = limit if full_in_s <= 0 else min(
                limit, remaining + (limit - remaining) * (now - at) / full_in_s)
            self.tokens_remaining.set(refilled, {"tenant": tenant})

    def record_tokens(self, tenant: str, reserved: int, used: int) -> None:
        """Account for one limited request's reservation and its settled cost, tokens."""
        if reserved:
            self.tokens_reserved.inc(reserved, {"tenant": tenant})
        if used:
            self.tokens_used.inc(used, {"tenant": tenant})

    def record_shadow(self, comparison) -> None:
        """Account for one compared mirror (:class:`serve_app.control.shadow_mirror.Comparison`)."""
        tags = {"route": comparison.route, "shadow": comparison.shadow}
        if comparison.shadow_error is not None:
            self.shadow_requests.inc(1, {**tags, "outcome": "shadow_error"})
            return
        self.shadow_requests.inc(1, {**tags, "outcome": "compared"})
        if comparison.exact:
            self.shadow_exact.inc(1, tags)
        self.shadow_similarity.observe(comparison.similarity, tags)
        if comparison.latency_ratio is not None:
            self.shadow_latency_ratio.observe(comparison.latency_ratio, tags)
