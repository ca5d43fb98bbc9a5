"""The autoscaling policy of a variant in a resident budget: Serve's own policy, except that
the last replica goes only when its replica says so.

Serve's autoscaler counts down ``downscale_delay_s`` (``downscale_to_zero_delay_s`` for the
last replica) from the moment its policy first wants fewer replicas, and a custom policy is
wrapped in that same countdown (``ray.serve.autoscaling_policy._apply_autoscaling_config``,
Ray 2.60). So no policy can send an idle variant to zero sooner than that delay, and the
router's resident budget must evict its least recently used variant *now*. This policy
turns it around: set ``downscale_to_zero_delay_s`` short (the eviction's delay, 1 s in the
shipped config) and the policy holds the last replica until it may go:

- while its engine has requests in flight, or Serve counted requests to it within
  ``look_back_period_s`` (at zero replicas, Serve's cold-start path would start one again
  at once for those), never;
- once its replica has been idle (no ``generate`` call) for ``downscale_delay_s`` (Serve's
  own idle scale-down, timed by the replica);
- as soon as it is idle when the router evicted it (``LLMReplica.evict``).

Each replica reports its ``mesh_in_flight``, ``mesh_idle_s`` and ``mesh_evicted`` with
Serve's custom autoscaling metrics (``LLMReplica.record_autoscaling_stats``, pushed every
``metrics_interval_s``). Above one replica, Serve's policy and delays apply unchanged.

Use it in a variant's ``autoscaling_config``::

    policy: {policy_function: serve_app.control.resident_policy:resident_budget_policy}

This module runs inside the Serve controller (Serve pickles it by value): it imports only Ray.
"""

from __future__ import annotations

from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

#: The replica's custom autoscaling metrics (``LLMReplica.record_autoscaling_stats``).
IN_FLIGHT, IDLE_S, EVICTED = "mesh_in_flight", "mesh_idle_s", "mesh_evicted"
#: ``policy_function`` of a variant's ``autoscaling_config.policy`` that uses this policy.
POLICY_FUNCTION = "serve_app.control.resident_policy:resident_budget_policy"


def latest(raw_metrics: dict | None, name: str) -> dict[Any, float]:
    """Replica id -> the latest reported value of custom metric ``name`` (replicas that have
    not reported it are absent)."""
    series = (raw_metrics or {}).get(name) or {}
    return {replica: max(points, key=lambda p: p.timestamp).value
            for replica, points in series.items() if points}


def may_stop(ctx) -> bool:
    """Whether the variant's replicas may all go: no request in Serve's look-back window
    (with one, Serve's cold-start path would start a replica again at once), every running
    replica has reported, none has a request in flight, and each was evicted or has been
    idle ``downscale_delay_s``."""
    if ctx.total_num_requests > 0:
        return False
    raw = ctx.raw_metrics
    in_flight, idle_s, evicted = (latest(raw, m) for m in (IN_FLIGHT, IDLE_S, EVICTED))
    replicas = list(ctx.running_replicas)
    if not replicas or any(r not in in_flight or r not in idle_s for r in replicas):
        return False  # a replica that has not reported yet (just started) stays
    if any(in_flight[r] > 0 for r in replicas):
        return False
    return all(evicted.get(r, 0) >= 1 or idle_s[r] >= ctx.config.downscale_delay_s
               for r in replicas)


def resident_budget_policy(ctx) -> tuple[float, dict]:
    """Serve's ``replica_queue_length_autoscaling_policy``, held at one replica until
    :func:`may_stop`.

    Args:
        ctx: Serve's ``AutoscalingContext`` for the variant's ``LLMReplica``.

    Returns:
        (desired replicas, policy state), as Serve's policies return them; Serve then
        applies its delays and the ``min_replicas``/``max_replicas`` bounds.
    """
    desired, state = replica_queue_length_autoscaling_policy(ctx)
    if ctx.current_num_replicas == 0:
        return desired, state  # asleep: Serve's cold-start path wakes it
    if ctx.current_num_replicas == 1 and may_stop(ctx):
        return 0, state
    return max(desired, 1), state
