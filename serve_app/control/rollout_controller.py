"""``RolloutController``: the one place that holds the mesh's progressive rollouts.

A Serve deployment of application ``mesh`` with one replica, beside the router. Every
``MeshRouter`` replica

- sends it the rollout policies of its ``user_config`` (:meth:`RolloutController.sync`)
  when a config is applied, and
- every :data:`REPORT_PERIOD_S` sends the :class:`~serve_app.control.rollout.Observation`s of its
  requests and reads back the weights the rollouts set (:meth:`RolloutController.report`).

So every router replica splits by the same weights, and a router replica that restarts
finds the rollout where it was: the state lives here, not in the router. The controller saves
every rollout's state and history in Ray's GCS key-value store (where Serve keeps its own
checkpoints) on each change, so a replacement controller replica takes them up again; only
the current step's figures start over. A rollout restarts only when a deployed config changes
its arms or ``rollout.id``.

Each decision is logged with its figures, counted in ``ray_mesh_rollout_decisions_total``
(``rollout``, ``decision``) and visible at the router's ``GET /admin/rollouts``; the
canary's current weight is the gauge ``ray_mesh_rollout_canary_weight`` (``rollout``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put
from ray.util.metrics import Counter, Gauge

from serve_app.common.logs import get_logger
from serve_app.control.rollout import Observation, Rollout, RolloutSpec, RolloutWeights
from serve_app.control.shadow_book import ShadowBook

logger = get_logger(__name__)

#: Seconds between two verdicts on every rollout, and between two router reports.
EVALUATE_PERIOD_S = 0.5
REPORT_PERIOD_S = 0.5

#: Where the state is saved in the GCS key-value store.
KV_NAMESPACE, KV_KEY = "model-mesh", "rollouts"


class RolloutController:
    """Holds every rollout by split key and judges them every :data:`EVALUATE_PERIOD_S`."""

    async def __init__(self) -> None:
        self.rollouts: dict[str, Rollout] = {}
        self.shadows = ShadowBook()
        self._weight = Gauge("mesh_rollout_canary_weight", "Canary weight set by a progressive "
                             "rollout, percent.", tag_keys=("rollout",))
        self._decisions = Counter("mesh_rollout_decisions", "Progressive rollout decisions.",
                                  tag_keys=("rollout", "decision"))
        saved = _internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)
        for key, state in json.loads(saved or "{}").items():
            self.rollouts[key] = Rollout.restore(state)
            logger.info("rollout %s: taken up again at %s, step %d", key,
                        self.rollouts[key].state, self.rollouts[key].step)
        self._task = asyncio.get_running_loop().create_task(self._evaluate_forever())

    async def sync(self, specs: list[RolloutSpec]) -> RolloutWeights:
        """Make the rollouts match a router's config; returns :meth:`weights`.

        A split with the same arms and ``policy.id`` keeps its state and takes the new
        policy (pause, resume, abort, steps, gates); otherwise it starts from its first step.
        Rollouts no longer in ``specs`` are dropped.
        """
        now = time.time()
        wanted = {spec.split: spec for spec in specs}
        for key in [k for k in self.rollouts if k not in wanted]:
            logger.info("rollout %s: removed from the config, its weights are the config's", key)
            del self.rollouts[key]
        for key, spec in wanted.items():
            current = self.rollouts.get(key)
            if current and current.identity == (spec.stable, spec.canary, spec.policy.id):
                before = len(current.history)
                current.apply_policy(spec.policy, now)
                self._log_new(current, before)
                continue
            rollout = Rollout(key, spec.stable, spec.canary, spec.policy, now)
            self.rollouts[key] = rollout
            self._log_new(rollout, 0)
        self._save()
        return self.weights()

    async def report(self, observations: list[Observation], comparisons: list = ()
                     ) -> RolloutWeights:
        """Take a router's observations and shadow comparisons
        (:class:`serve_app.control.shadow_mirror.Comparison`); returns :meth:`weights`."""
        for o in observations:
            rollout = self.rollouts.get(o.split)
            if rollout is not None:
                rollout.observe(o)
        for c in comparisons:
            self.shadows.add(c)
            rollout = self.rollouts.get(c.route)
            if rollout is not None:
                rollout.observe_shadow(c)
        return self.weights()

    async def shadow_snapshot(self) -> dict[str, Any]:
        """Aggregates of every route's shadow comparisons (:class:`ShadowBook`)."""
        return self.shadows.snapshot()

    def weights(self) -> RolloutWeights:
        """The weights of every rollout, and the rollouts in a shadow phase."""
        return RolloutWeights(
            {key: r.weights() for key, r in self.rollouts.items()},
            {key: (r.canary, r.policy.shadow) for key, r in self.rollouts.items()
             if r.state == "shadowing"})

    async def snapshot(self) -> dict[str, Any]:
        """Every rollout's state and decision history (``Rollout.to_dict``), by split key."""
        return {key: r.to_dict() for key, r in self.rollouts.items()}

    async def _evaluate_forever(self) -> None:
        while True:
            await asyncio.sleep(EVALUATE_PERIOD_S)
            now = time.time()
            decided = False
            for rollout in list(self.rollouts.values()):
                before = len(rollout.history)
                try:
                    rollout.evaluate(now)
                except Exception:  # one broken rollout must not stop the others
                    logger.exception("rollout %s: evaluation failed", rollout.key)
                decided |= self._log_new(rollout, before)
            if decided:
                self._save()

    def _save(self) -> None:
        _internal_kv_put(KV_KEY, json.dumps({k: r.to_dict() for k, r in self.rollouts.items()}),
                         overwrite=True, namespace=KV_NAMESPACE)

    def _log_new(self, rollout: Rollout, before: int) -> bool:
        """Log, count and export the decisions made since ``before`` entries of history;
        True if there were any."""
        for d in rollout.history[before:]:
            logger.info("rollout %s: %s -> canary %s at %d%% (%s); canary %s; stable %s",
                        rollout.key, d["decision"], rollout.canary, d["canary_weight"],
                        d["reason"], json.dumps(d["canary"]), json.dumps(d["stable"]))
            self._decisions.inc(1, {"rollout": rollout.key, "decision": d["decision"]})
        self._weight.set(rollout.canary_weight, {"rollout": rollout.key})
        return len(rollout.history) > before
