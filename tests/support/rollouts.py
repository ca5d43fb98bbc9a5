"""Rollouts on serve_configs/canary.yaml (smollm-v1 stable, smollm-v2 canary): a config with one,
its state from the router, and a rollout that never advances on its own."""

from __future__ import annotations

import copy

import httpx

from tests.support.serve_config import router_uc

#: The admin tenant of serve_configs/canary.yaml.
ADMIN = {"authorization": "Bearer sk-mesh-ops-demo"}

#: A rollout that stays on its first step for the length of a test (no gates).
SLOW = {"steps": [50, 100], "min_requests": 100_000, "min_step_s": 3600,
        "gates": {"max_ttft_p95_ratio": None, "max_latency_p95_ratio": None}}


def with_rollout(base, rollout: dict, canary_user_config: dict | None = None):
    """canary.yaml with a rollout of smollm-v2 (canary) against smollm-v1 (stable)."""
    cfg = copy.deepcopy(base)
    route = router_uc(cfg)["routes"]["smollm"]
    route["variants"] = [{"application": "smollm-v1", "weight": 100},
                         {"application": "smollm-v2", "weight": 0}]
    route["rollout"] = {"min_requests": 4, "min_step_s": 2,
                        "gates": {"max_ttft_p95_ratio": 3.0, "max_latency_p95_ratio": 3.0},
                        **rollout}
    if canary_user_config:
        cfg["applications"][2]["deployments"][0]["user_config"].update(canary_user_config)
    return cfg


def rollout_state(http: httpx.Client) -> dict:
    """Route ``smollm``'s rollout as ``GET /admin/rollouts`` shows it."""
    r = http.get("/admin/rollouts", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["smollm"]
