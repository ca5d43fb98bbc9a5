"""The router's side of progressive rollouts: the weights in force, and the observations.

Each router replica sends the ``RolloutController`` (:mod:`serve_app.control.rollout_controller`)
its config's rollouts (``sync``) and, every :data:`REPORT_PERIOD_S`, what it saw of each
request (``report``); both answer with the weights every rollout sets now, which this router
then splits by. A router that cannot reach the controller keeps the last weights it read; one
that never reached it sends a rollout's stable arm everything.
"""

from __future__ import annotations

import asyncio

from serve_app.common.logs import get_logger
from serve_app.request.split import Split
from serve_app.control.rollout import Observation, RolloutSpec, RolloutWeights
from serve_app.control.rollout_controller import REPORT_PERIOD_S

logger = get_logger(__name__)

#: Observations kept for the rollout controller while it cannot be reached; newer ones are
#: dropped above this (the controller judges on counts, so losing some only slows a verdict).
MAX_PENDING_OBSERVATIONS = 10_000


class RolloutClient:
    """Weights in force and buffered observations of one router replica.

    Args:
        controller: ``DeploymentHandle`` of the ``RolloutController``.
    """

    def __init__(self, controller) -> None:
        self.controller = controller
        self.splits: dict[str, Split] = {}
        self._weights = RolloutWeights({})
        self._pending: list[Observation] = []
        self._comparisons: list = []  # shadow Comparisons for the controller
        self._synced = True
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Report and read weights every :data:`REPORT_PERIOD_S` from now on."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def apply(self, splits: dict[str, Split]) -> None:
        """Take a new config's splits and send its rollouts to the controller.

        Raises:
            Exception: the controller did not answer (the loop retries in the background).
        """
        self.splits = splits
        self._synced = False
        await self._sync()

    async def _sync(self) -> None:
        specs = [RolloutSpec(key, split.weighted[0][0], split.weighted[-1][0], split.rollout)
                 for key, split in self.splits.items() if split.rollout]
        self._weights = await self.controller.sync.remote(specs)
        self._synced = True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            try:
                if not self._synced:
                    await self._sync()
                if any(split.rollout for split in self.splits.values()) or self._comparisons:
                    batch, self._pending = self._pending, []
                    compared, self._comparisons = self._comparisons, []
                    self._weights = await self.controller.report.remote(batch, compared)
            except Exception as e:  # keep the last weights; the controller may be restarting
                logger.warning("rollout controller: %s: %s", type(e).__name__, str(e)[:300])

    def weighted(self, key: str, split: Split) -> list[tuple[str, int]]:
        """The arms of ``split`` (the split ``key`` of the caller's config) with the weights
        in force: the rollout's when it has one (its stable arm alone until the controller
        has answered), else the config's. The caller passes its split: a request planned
        under the last config may still be running while :meth:`apply` takes the next."""
        if split.rollout is None:
            return split.weighted
        weights = self._weights.by_split.get(key) or {split.weighted[0][0]: 100}
        return [(arm, weights.get(arm, 0)) for arm, _ in split.weighted]

    def shadow_phase(self, route: str):
        """``(canary, ShadowPhase)`` while the route's rollout is in its shadow phase."""
        return self._weights.shadowing.get(route)

    def observe_shadow(self, comparison) -> None:
        """Queue a shadow :class:`~serve_app.control.shadow_mirror.Comparison` for the controller."""
        if len(self._comparisons) < MAX_PENDING_OBSERVATIONS:
            self._comparisons.append(comparison)

    def weights(self) -> dict[str, dict[str, int]]:
        """Split key -> arm -> weight in force (for logs and ``/health``)."""
        return {key: dict(self.weighted(key, split)) for key, split in self.splits.items()}

    def observe(self, arms: tuple[tuple[str, str], ...], *, error: bool, truncated: bool = False,
                ttft_s: float | None = None, latency_s: float) -> None:
        """Queue an observation for each ``(split key, arm)`` that is under a rollout."""
        for key, arm in arms:
            split = self.splits.get(key)
            if split and split.rollout and len(self._pending) < MAX_PENDING_OBSERVATIONS:
                self._pending.append(Observation(key, arm, error, truncated, ttft_s, latency_s))
