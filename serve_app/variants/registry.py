"""``VariantRegistry``: a router replica's view of its variants, in one object.

For each variant (a Serve application running ``LLMReplica``) it holds the
``DeploymentHandle``, the admission queue (:class:`~serve_app.admission.variant_queue.
VariantAdmission`), and the parts that follow whether it runs: availability (what its
replicas last reported), cold starts of a variant at zero replicas, and the resident budget.
The stages that act on a variant (the dispatcher, the shadow mirror) take this object, not
callbacks into the router; the router gives it each new config (:meth:`configure`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray import serve

from serve_app.admission.variant_queue import VariantAdmission
from serve_app.common.config import RouterConfig
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT
from serve_app.variants.availability import VariantAvailability
from serve_app.variants.cold_start import ColdStarts
from serve_app.variants.resident_budget import ResidentBudget

#: Cold-start limit of a variant no route names, s (the route default's).
DEFAULT_COLD_START_TIMEOUT_S = 180.0


def replica_handle(application: str):
    """The ``DeploymentHandle`` of ``application``'s ``LLMReplica`` deployment."""
    return serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=application)


class VariantRegistry:
    """Handles, admission queues, availability, cold starts and the resident budget of the
    variants one router replica sends to.

    Args:
        metrics: the router's :class:`~serve_app.observability.metrics.MeshMetrics` (None in
            unit tests: nothing recorded).
        handle_for: application name -> its replica handle (default :func:`replica_handle`;
            unit tests pass fakes). Each handle is made once and kept.
        availability: the availability view (default: polled from the replicas; unit tests
            pass fakes).
    """

    def __init__(self, metrics=None, handle_for: Callable[[str], Any] = replica_handle,
                 availability=None) -> None:
        self.metrics = metrics
        self.config: RouterConfig | None = None
        self._handle_for = handle_for
        self._handles: dict[str, Any] = {}
        self._admission: dict[str, VariantAdmission] = {}
        #: Mirrored requests in flight per variant (the shadow mirror counts them): a
        #: variant with one is busy, like one with a request of its own.
        self.mirrors: dict[str, int] = {}
        self.availability = availability if availability is not None else \
            VariantAvailability(self.handle, on_refresh=self.update_slots)
        self.budget = ResidentBudget(self.handle, self.availability, self.busy, metrics)
        self.cold_starts = ColdStarts(self.handle, self.availability, metrics, self.budget,
                                      self.admission, self.cold_start_limit_s)

    def configure(self, config: RouterConfig) -> None:
        """Apply a new router config: the resident budget, each route's admission settings
        and each variant's slots."""
        self.config = config
        budget = config.resident_budget
        self.budget.configure(budget.max_variants if budget else None,
                              budget.evict_timeout_s if budget else 60.0)
        self.update_slots()

    def handle(self, application: str):
        """``application``'s replica handle."""
        if application not in self._handles:
            self._handles[application] = self._handle_for(application)
        return self._handles[application]

    def admission(self, application: str) -> VariantAdmission:
        """``application``'s admission queue (made on first use)."""
        if application not in self._admission:
            self._admission[application] = VariantAdmission(application)
        return self._admission[application]

    def busy(self, application: str) -> bool:
        """This router has requests (or shadow mirrors) in flight or queued for
        ``application``."""
        queue = self._admission.get(application)
        return bool(queue is not None and (queue.in_flight or queue.queued)
                    or self.mirrors.get(application, 0))

    def cold_start_limit_s(self, application: str) -> float:
        """How long a cold start of ``application`` may take before it counts as failed, s:
        the largest ``cold_start_timeout_s`` of the routes it serves."""
        routes = self.config.routes.values() if self.config else ()
        return max((rc.cold_start_timeout_s for rc in routes
                    if any(v.application == application for v in rc.variants)),
                   default=DEFAULT_COLD_START_TIMEOUT_S)

    def context_len(self, candidates: tuple[str, ...]) -> int:
        """The largest ``max_model_len`` the ``candidates`` reported, tokens (0: none
        known): a request with no ``max_tokens`` may generate up to it there."""
        info = self.availability.info
        return max((info[c].max_model_len for c in candidates if c in info), default=0)

    def update_slots(self) -> None:
        """Each route's admission settings and each variant's slots (from availability) on
        the variants' admission queues; the variant-state gauges."""
        for rc in (self.config.routes.values() if self.config else ()):
            for v in rc.variants:
                queue = self.admission(v.application)
                queue.configure(**rc.admission.model_dump())
                queue.set_capacity(self.availability.slots(v.application),
                                   self.availability.full_batch_service_s(v.application))
        if self.metrics is not None:
            self.metrics.refresh_gauges(self.availability.states())
