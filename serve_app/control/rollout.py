"""Progressive rollout of one split's canary: steps, gates and verdicts (pure logic).

A *split* is a weighted choice between arms: a route's variant applications, or an
adapter's versions (``route:adapter``, arms ``name@vN``). A :class:`Rollout` owns the
weights of a split with two arms, stable (first) and canary (last), and moves the canary
through ``policy.steps`` the way Flagger's canary analysis does (https://docs.flagger.app,
"Canary analysis"): each step needs ``min_requests`` canary requests and ``min_step_s``
seconds with every gate holding; the last step passed promotes the canary (weight 100); a
failed gate rolls it back (weight 0) at once.

Figures come from :class:`Observation`s the routers send (one per request that reached an
arm): the canary's over the current step, the stable arm's over the whole rollout (the last
:data:`STABLE_WINDOW` requests), so a ratio has a baseline even at step 100.

States: ``progressing`` -> ``promoted`` | ``rolled_back``; ``paused`` and ``aborted`` come
from the config (``policy.paused`` / ``policy.abort``). Every transition is a decision in
:attr:`Rollout.history`, with the figures behind it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from serve_app.common.policies import RolloutGates, RolloutPolicy, ShadowPhase
from serve_app.observability.stats import percentile

#: Stable-arm requests kept as the baseline, most recent first out.
STABLE_WINDOW = 2000
#: States a rollout never leaves (its verdict).
FINAL_STATES = ("promoted", "rolled_back", "aborted")
#: Fewest stable samples a p95 ratio gate needs; with fewer the ratio is not judged.
MIN_BASELINE = 5

ACTIVE = ("shadowing", "progressing", "paused")


@dataclass(frozen=True)
class Observation:
    """One request's outcome on one arm of a split, as a router saw it.

    Attributes:
        split: the split's key (``route`` or ``route:adapter``).
        arm: the variant application, or the adapter version ``name@vN``.
        error: a variant failure: a failure before the first byte, or a stream cut short.
        truncated: a stream cut short after it started.
        ttft_s: time to the first streamed chunk, s (None when not streamed or failed).
        latency_s: end-to-end latency, s.
    """

    split: str
    arm: str
    error: bool
    truncated: bool
    ttft_s: float | None
    latency_s: float


@dataclass(frozen=True)
class RolloutSpec:
    """A rollout as a router's config declares it (router -> ``RolloutController.sync``).

    Attributes:
        split: the split's key (``route`` or ``route:adapter``).
        stable: its first arm; canary: its last arm.
        policy: steps, minimums and gates.
    """

    split: str
    stable: str
    canary: str
    policy: RolloutPolicy


@dataclass(frozen=True)
class RolloutWeights:
    """The weights every rollout sets now (``RolloutController`` -> routers).

    Attributes:
        by_split: split key -> arm -> weight (percent).
        shadowing: route -> ``(canary, ShadowPhase)`` of the rollouts in a shadow phase (the
            routers mirror the route's requests to the canary meanwhile).
    """

    by_split: dict[str, dict[str, int]]
    shadowing: dict[str, tuple[str, ShadowPhase]] = field(default_factory=dict)


def figures(observations) -> dict[str, Any]:
    """Counts and p95s of observations: ``requests``, ``errors``, ``error_rate`` (0..1),
    ``truncated``, ``ttft_p95_ms`` and ``latency_p95_ms`` (over requests without error; None
    when there are none), ``samples`` (requests without error)."""
    obs = list(observations)
    good = [o for o in obs if not o.error]
    ttft = [o.ttft_s * 1000 for o in good if o.ttft_s is not None]
    errors = sum(o.error for o in obs)
    return {
        "requests": len(obs),
        "errors": errors,
        "error_rate": round(errors / len(obs), 4) if obs else 0.0,
        "truncated": sum(o.truncated for o in obs),
        "samples": len(good),
        "ttft_p95_ms": round(percentile(ttft, 95), 1) if ttft else None,
        "latency_p95_ms": round(percentile([o.latency_s * 1000 for o in good], 95), 1)
        if good else None,
    }


def failed_gates(gates: RolloutGates, canary: dict[str, Any], stable: dict[str, Any]
                 ) -> list[str]:
    """The gates the canary's :func:`figures` break against the stable arm's, each as a
    sentence with the figures; empty when all hold."""
    failed = []
    increase = canary["error_rate"] - stable["error_rate"]
    if increase > gates.max_error_rate_increase:
        failed.append(f"error rate {canary['error_rate']:.1%} vs stable "
                      f"{stable['error_rate']:.1%} (+{increase:.1%} > "
                      f"+{gates.max_error_rate_increase:.1%})")
    if canary["truncated"] > gates.max_truncated_streams:
        failed.append(f"{canary['truncated']} truncated streams > "
                      f"{gates.max_truncated_streams}")
    for name, limit in (("ttft_p95_ms", gates.max_ttft_p95_ratio),
                        ("latency_p95_ms", gates.max_latency_p95_ratio)):
        c, s = canary[name], stable[name]
        if limit is None or c is None or s is None or stable["samples"] < MIN_BASELINE:
            continue
        if c / s > limit:
            failed.append(f"{name[:-7]} p95 {c:.0f} ms vs stable {s:.0f} ms "
                          f"(x{c / s:.2f} > x{limit})")
    return failed


def shadow_figures(comparisons) -> dict[str, Any]:
    """Figures of a shadow phase's comparisons (:class:`serve_app.control.shadow_mirror.Comparison`):
    ``compared``, ``errors``, ``error_rate``, ``agreement`` (exact matches over the pairs the
    shadow answered), ``similarity`` (mean), ``latency_ratio_p50``."""
    cs = list(comparisons)
    answered = [c for c in cs if c.shadow_error is None]
    ratios = [c.latency_ratio for c in answered if c.latency_ratio is not None]
    return {
        "compared": len(cs),
        "errors": len(cs) - len(answered),
        "error_rate": round((len(cs) - len(answered)) / len(cs), 4) if cs else 0.0,
        "agreement": round(sum(c.exact for c in answered) / len(answered), 4)
        if answered else None,
        "similarity": round(sum(c.similarity for c in answered) / len(answered), 4)
        if answered else None,
        "latency_ratio_p50": round(percentile(ratios, 50), 3) if ratios else None,
    }


def failed_shadow_gates(phase: ShadowPhase, f: dict[str, Any]) -> list[str]:
    """The shadow phase's gates that :func:`shadow_figures` break, as sentences."""
    failed = []
    if f["error_rate"] > phase.max_error_rate:
        failed.append(f"shadow error rate {f['error_rate']:.1%} > {phase.max_error_rate:.1%}")
    if f["agreement"] is not None and f["agreement"] < phase.min_agreement:
        failed.append(f"agreement {f['agreement']:.1%} < {phase.min_agreement:.1%}")
    if f["similarity"] is not None and f["similarity"] < phase.min_similarity:
        failed.append(f"similarity {f['similarity']:.2f} < {phase.min_similarity:.2f}")
    ratio = f["latency_ratio_p50"]
    if phase.max_latency_ratio is not None and ratio is not None and \
            ratio > phase.max_latency_ratio:
        failed.append(f"latency ratio {ratio:.2f} > {phase.max_latency_ratio:.2f}")
    return failed


class Rollout:
    """The state of one split's rollout.

    Args:
        key: the split's key.
        stable, canary: the two arms.
        policy: steps, minimums and gates.
        now: the current time, s since the epoch (tests pass their own clock).
    """

    def __init__(self, key: str, stable: str, canary: str, policy: RolloutPolicy,
                 now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.key, self.stable, self.canary, self.policy = key, stable, canary, policy
        self.state = "shadowing" if policy.shadow else "progressing"
        self.step = 0
        self.started_at = self.step_started_at = now
        self.canary_window: list[Observation] = []
        self.shadow_window: list = []  # Comparisons of the shadow phase
        self.stable_window: deque[Observation] = deque(maxlen=STABLE_WINDOW)
        self.history: list[dict[str, Any]] = []
        self._decide("start", now, f"rollout {policy.id!r}: {canary} against {stable}, "
                     f"steps {policy.steps}")
        self.apply_policy(policy, now)

    @classmethod
    def restore(cls, saved: dict[str, Any]) -> Rollout:
        """Rebuild a rollout from :meth:`to_dict` (the current step's figures start over)."""
        r = cls(saved["key"], saved["stable"], saved["canary"],
                RolloutPolicy.model_validate(saved["policy"]), now=saved["started_at"])
        r.state, r.step = saved["state"], saved["step"]
        r.step_started_at, r.history = saved["step_started_at"], list(saved["history"])
        return r

    @property
    def identity(self) -> tuple[str, str, str]:
        """What a config must keep for this rollout to go on: arms and ``policy.id``."""
        return self.stable, self.canary, self.policy.id

    @property
    def canary_weight(self) -> int:
        """The canary's weight in percent (the stable arm gets the rest)."""
        if self.state == "promoted":
            return 100
        if self.state in ("rolled_back", "aborted", "shadowing"):
            return 0
        return self.policy.steps[self.step]

    def weights(self) -> dict[str, int]:
        return {self.stable: 100 - self.canary_weight, self.canary: self.canary_weight}

    def observe(self, o: Observation) -> None:
        if o.arm == self.canary and self.state == "progressing":
            self.canary_window.append(o)
        elif o.arm == self.stable:
            self.stable_window.append(o)

    def observe_shadow(self, comparison) -> None:
        """A mirrored pair of the shadow phase (the canary was the shadow)."""
        if self.state == "shadowing" and comparison.shadow == self.canary:
            self.shadow_window.append(comparison)

    def apply_policy(self, policy: RolloutPolicy, now: float) -> None:
        """Take a redeployed policy: pause, resume or abort; new steps and gates apply to the
        next verdict (the current step index is kept, clamped to the new steps)."""
        self.policy = policy
        self.step = min(self.step, len(policy.steps) - 1)
        if policy.abort and self.state in ACTIVE:
            self.state = "aborted"
            self._decide("abort", now, "abort: true in the deployed config")
        elif policy.paused and self.state == "progressing":
            self.state = "paused"
            self._decide("pause", now, "paused: true in the deployed config")
        elif not policy.paused and self.state == "paused":
            self.state = "progressing"
            self.step_started_at = now
            self._decide("resume", now, "paused: false in the deployed config")

    def evaluate(self, now: float) -> dict[str, Any] | None:
        """Judge the current step; returns the decision taken, or None (not enough yet).

        With ``min_requests`` canary requests in the step: a failed gate rolls back; all
        gates holding after ``min_step_s`` advance to the next step, or promote after the
        last one. In a shadow phase, with ``shadow.min_requests`` comparisons: a failed
        shadow gate rolls back (the canary never had weight); else the steps start."""
        if self.state == "shadowing":
            return self._evaluate_shadow(now)
        if self.state != "progressing" or len(self.canary_window) < self.policy.min_requests:
            return None
        failed = failed_gates(self.policy.gates, figures(self.canary_window),
                              figures(self.stable_window))
        if failed:
            self.state = "rolled_back"
            return self._decide("rollback", now, "; ".join(failed))
        if now - self.step_started_at < self.policy.min_step_s:
            return None
        passed = self.canary_weight
        if self.step == len(self.policy.steps) - 1:
            self.state = "promoted"
            return self._decide("promote", now, f"every gate held through the last step "
                                f"({passed}%)")
        finished, self.canary_window = self.canary_window, []
        self.step += 1
        self.step_started_at = now
        return self._decide("advance", now, f"every gate held at {passed}%", finished)

    def _evaluate_shadow(self, now: float) -> dict[str, Any] | None:
        phase = self.policy.shadow
        if len(self.shadow_window) < phase.min_requests:
            return None
        failed = failed_shadow_gates(phase, shadow_figures(self.shadow_window))
        if failed:
            self.state = "rolled_back"
            return self._decide("rollback", now, "shadow phase: " + "; ".join(failed))
        self.state = "progressing"
        self.step_started_at = now
        return self._decide("shadow-pass", now, f"every shadow gate held over "
                            f"{len(self.shadow_window)} comparisons")

    def _decide(self, decision: str, now: float, reason: str,
                canary_window: list[Observation] | None = None) -> dict[str, Any]:
        """Record a decision with the state after it and the figures behind it."""
        window = self.canary_window if canary_window is None else canary_window
        record = {"at": round(now, 3), "decision": decision, "state": self.state,
                  "step": self.step, "canary_weight": self.canary_weight, "reason": reason,
                  "canary": figures(window), "stable": figures(self.stable_window)}
        if self.policy.shadow is not None:
            record["shadow"] = shadow_figures(self.shadow_window)
        self.history.append(record)
        return record

    def to_dict(self) -> dict[str, Any]:
        """State for the admin endpoint: arms, state, step, weights, the figures so far
        (``current_step``), policy and history."""
        return {"key": self.key, "stable": self.stable, "canary": self.canary,
                "state": self.state, "step": self.step, "weights": self.weights(),
                "started_at": self.started_at, "step_started_at": self.step_started_at,
                "current_step": {"canary": figures(self.canary_window),
                                 "stable": figures(self.stable_window),
                                 "shadow": shadow_figures(self.shadow_window)},
                "policy": self.policy.model_dump(), "history": list(self.history)}
