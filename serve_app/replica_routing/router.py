"""``AffinityRouter``: the Serve request router that picks a variant's replica by prefix,
session and adapter affinity (:mod:`serve_app.replica_routing.affinity`), for ``LLMReplica``
deployments.

Configured per variant in the Serve config, on the ``LLMReplica`` deployment::

    request_router_config:
      request_router_class: serve_app.replica_routing.router:AffinityRouter
      request_router_kwargs: {imbalance_bound: 4, block_chars: 128}

It runs inside every process that holds a handle to the variant (the mesh router's replicas),
on Serve's request-router API (Ray 2.60: ``RequestRouter``, ``FIFOMixin``): Serve asks it for
ranks of replicas and then takes the least-loaded replica with room in the first rank that has
one, so a full preferred replica falls through to the next rank by Serve's own rules.

Why not Ray's ``PrefixCacheAffinityRouter``: its prefix matcher reads a ``.messages`` or
``.prompt`` attribute of the call's arguments (ours is one
:class:`~serve_app.common.wire.GenerateRequest` holding the OpenAI body), it keeps its prefix
tree in a detached actor that it calls with a blocking ``ray.get`` on every request, inside
the router's event loop, and its default imbalance bound is infinite (one hot prefix queues
behind one engine). Kept from Serve: the queue-length cache and probes (loads), the FIFO
order of pending requests, the rank fall-through, replica-set updates.

Adapter affinity uses Serve's routing-stats channel (``record_routing_stats`` on the replica,
polled every ``request_routing_stats_period_s``, read here as ``replica.routing_stats``) for
which adapters each replica holds and its engine's ``max_loras``; which adapters this router's
requests in flight use on each replica comes from Serve's ``on_request_routed`` and
``on_request_completed`` hooks (the LoRA batch-slot rule of
:mod:`~serve_app.replica_routing.affinity`). Why not Serve's model multiplexing
(``@serve.multiplexed`` + ``multiplexed_model_id``): its LRU evicts a model without asking
whether a request is using it, a request then goes only to replicas that report the model
(prefix and session affinity could not be combined with it), and the router's load bound
would not apply. The replica's :class:`~serve_app.server.lora.AdapterSet` keeps the LRU and
never evicts an adapter in use; this router only prefers the replicas that hold it.

Calls other than ``generate`` (availability polls, stats) go to any replica, least-loaded
first, as with Serve's default router. So does a ``generate`` call whose affinity the router
cannot work out: :meth:`AffinityRouter.choose_replicas` never raises (an exception there is
Serve's failure to route, which the mesh would count as the variant's), it logs and falls
back to Serve's own choice among all the candidates.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from serve_app.common.logs import get_logger

from ray.serve.request_router import FIFOMixin, RequestRouter  # Serve's public custom-router API
from ray.util.metrics import Counter

from serve_app.common.wire import GenerateRequest
from serve_app.replica_routing.affinity import (BLOCK_CHARS, IMBALANCE_BOUND, MAX_BLOCKS,
                                                MIN_MATCH_RATE, MAX_SESSIONS, ReplicaAffinity,
                                                prefix_keys, prompt_text)

logger = get_logger(__name__)

#: Seconds between two logged tracebacks of the router's fallback (a client can send any
#: number of bodies that reach it).
FALLBACK_LOG_EVERY_S = 60.0

#: ``request_router_class`` of a variant that routes with :class:`AffinityRouter`.
AFFINITY_ROUTER = "serve_app.replica_routing.router:AffinityRouter"

_decisions = None  # the process's one Counter (Ray metrics: one object per name)


def _decision_counter() -> Counter:
    global _decisions
    if _decisions is None:
        _decisions = Counter("mesh_replica_routing_decisions",
                             "Replica choices of the affinity router: session, hit (a replica "
                             "holding the prompt's prefix), adapter (one holding its LoRA "
                             "adapter), spill (that replica was past the imbalance bound), "
                             "new (no replica held it), newcomer (a request in a newcomer "
                             "slot, to an engine seat free of recent prefills), single (one "
                             "replica).",
                             tag_keys=("variant", "decision"))
    return _decisions


def affinity_settings(kwargs: dict[str, Any]) -> tuple[ReplicaAffinity, int]:
    """The affinity table and ``block_chars`` for ``request_router_kwargs`` (``meshctl
    validate`` checks a config with this too).

    Raises:
        ValueError: an unknown keyword or a bad value (the message names it).
    """
    known = {"imbalance_bound": IMBALANCE_BOUND, "block_chars": BLOCK_CHARS,
             "max_blocks": MAX_BLOCKS, "max_sessions": MAX_SESSIONS,
             "adapter_imbalance_bound": None, "min_match_rate": MIN_MATCH_RATE}
    if unknown := sorted(set(kwargs) - set(known)):
        raise ValueError(f"unknown AffinityRouter keyword {', '.join(unknown)} "
                         f"(known: {', '.join(known)})")
    s = {**known, **kwargs}
    rate = s.pop("min_match_rate")
    if not all(isinstance(v, int) and not isinstance(v, bool) for k, v in s.items()
               if not (k == "adapter_imbalance_bound" and v is None)):
        raise ValueError(f"AffinityRouter keywords other than min_match_rate are integers "
                         f"(adapter_imbalance_bound may be null: each replica's max_num_seqs), "
                         f"got {kwargs}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise ValueError(f"min_match_rate is a number from 0 to 1, not {rate!r}")
    if s["block_chars"] < 1:
        raise ValueError(f"block_chars must be >= 1, not {s['block_chars']}")
    return ReplicaAffinity(s["imbalance_bound"], s["max_blocks"], s["max_sessions"],
                           s["adapter_imbalance_bound"], float(rate)), s["block_chars"]


def affinity_inputs(request: GenerateRequest, block_chars: int
                    ) -> tuple[list[bytes], str | None, str | None]:
    """The prefix keys, session and LoRA adapter (``name@vN`` when the router chose a
    version, else ``name``; None for the base model) of one ``generate`` call."""
    model = request.body.get("model") if isinstance(request.body, dict) else None
    _, _, adapter = model.partition(":") if isinstance(model, str) else ("", "", "")
    adapter = request.adapter_version or adapter or None
    text = prompt_text(request.endpoint, request.body)
    return prefix_keys(text, adapter, block_chars), request.session, adapter


def reported_stats(replicas) -> tuple[dict[Any, tuple[list[str], float]], dict[Any, int],
                                      dict[Any, int]]:
    """What the replicas report in Serve's routing stats (``LLMReplica.record_routing_stats``),
    read in one pass: replica id -> (its resident adapters, report time) (none for a replica
    that has not reported), replica id -> its engine's ``max_loras``, and -> its
    ``max_num_seqs`` (a replica that has not reported a limit, or reports 0, is left out of
    that one)."""
    adapters, max_loras, max_num_seqs = {}, {}, {}
    for r in replicas:
        stats = r.routing_stats or {}
        adapters[r.replica_id] = (stats.get("adapters") or [], float(stats.get("at") or 0.0))
        for limit, out in (("max_loras", max_loras), ("max_num_seqs", max_num_seqs)):
            if stats.get(limit):
                out[r.replica_id] = int(stats[limit])
    return adapters, max_loras, max_num_seqs


def rank_replicas(affinity: ReplicaAffinity, keys: list[bytes], session: str | None,
                  adapter: str | None, loads: dict[Any, int | None], replicas,
                  newcomer: bool = False):
    """``affinity``'s choice among ``replicas`` (Serve's running replicas, ``loads``: their
    requests in flight, None where not known: counted as 0) for a request with prefix
    ``keys``, ``session`` and ``adapter`` (``newcomer``: started in a newcomer slot), with
    what the replicas report in their routing stats (:func:`reported_stats`): resident
    adapters, ``max_loras`` and ``max_num_seqs`` (:meth:`ReplicaAffinity.choose`)."""
    adapters, max_loras, max_num_seqs = reported_stats(replicas)
    holders = affinity.adapter_holders(adapter, adapters)
    return affinity.choose(keys, session, {r: n or 0 for r, n in loads.items()}, adapter,
                           holders, max_loras, max_num_seqs, newcomer,
                           unknown={r for r, n in loads.items() if n is None})


class AffinityRouter(FIFOMixin, RequestRouter):
    """Serve request router with prefix and session affinity under a load bound.

    ``request_router_kwargs``: ``imbalance_bound`` (requests in flight, default 4),
    ``adapter_imbalance_bound`` (the same for adapter residency, default each replica's
    ``max_num_seqs``), ``block_chars`` (characters per prefix block, default 128),
    ``min_match_rate`` (share of the prompt's blocks a cached run must cover to count as a
    hit, default 0.5), ``max_blocks``, ``max_sessions`` (LRU bounds of the table).

    Raises:
        ValueError: a bad keyword (:func:`affinity_settings`), when Serve makes the handle.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.affinity, self.block_chars = affinity_settings(kwargs)
        # request id -> ((prefix keys, session, adapter), decision) of its latest attempt
        self._chosen: OrderedDict[str, tuple[tuple, str]] = OrderedDict()
        # request id -> (replica id, adapter) of a LoRA request routed and not completed
        self._in_flight: OrderedDict[str, tuple[Any, str]] = OrderedDict()
        self._variant = self._deployment_id.app_name if self._deployment_id else ""

    def _request(self, pending) -> GenerateRequest | None:
        if pending is None or pending.metadata.call_method != "generate" or not pending.args:
            return None
        request = pending.args[0]
        return request if isinstance(request, GenerateRequest) else None

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """Serve's ranks of ``candidate_replicas`` for ``pending_request``; never raises:
        anything unexpected is logged and leaves the choice to Serve (one rank of all)."""
        try:
            return self._choose(candidate_replicas, pending_request)
        except Exception:  # noqa: BLE001 - a request's routing must not fail on our rules
            self._fallback("choose_replicas")
            return [candidate_replicas]

    def _fallback(self, where: str) -> None:
        now = time.monotonic()
        if now - getattr(self, "_logged_at", -FALLBACK_LOG_EVERY_S) >= FALLBACK_LOG_EVERY_S:
            self._logged_at = now
            logger.exception("affinity router (%s) of %s failed; Serve's default choice "
                             "routes the request (logged at most every %.0f s)", where,
                             self._variant, FALLBACK_LOG_EVERY_S)

    def _choose(self, candidate_replicas, pending_request):
        request = self._request(pending_request)
        if request is None:
            return [candidate_replicas]
        keys, session, adapter = affinity_inputs(request, self.block_chars)
        if len(candidate_replicas) < 2:
            self._remember(pending_request, (keys, session, adapter), "single")
            return [candidate_replicas]
        # None: not known (counted as 0; Serve probes before it sends)
        loads = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id)
                 for r in candidate_replicas}
        choice = rank_replicas(self.affinity, keys, session, adapter, loads, candidate_replicas,
                               request.newcomer)
        if adapter and choice.decision in ("new", "spill") and len(choice.ranks[0]) == 1:
            # loaded anew there (one replica: Serve picks no other): a burst's next requests,
            # chosen before this one is routed, follow it (not the least loaded)
            self.affinity.placed(adapter, choice.ranks[0][0], at=time.time())
        if choice.decision == "newcomer":  # a burst's next newcomers go elsewhere
            self.affinity.sent(choice.ranks[0][0], at=time.time())
        self._remember(pending_request, (keys, session, adapter), choice.decision)
        return [[self._replicas[rid] for rid in rank if rid in self._replicas]
                for rank in choice.ranks]

    def _remember(self, pending_request, inputs: tuple, decision: str) -> None:
        """The inputs and decision of the request's latest routing attempt, recorded and
        counted once it is routed (the keys are hashed once per attempt, not again)."""
        self._chosen[pending_request.metadata.internal_request_id] = (inputs, decision)
        while len(self._chosen) > 10_000:  # requests cancelled before they were routed
            self._chosen.popitem(last=False)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        try:
            self._routed(pending_request, replica_id)
        except Exception:  # noqa: BLE001 - Serve's hook: routing is done, only learning failed
            self._fallback("on_request_routed")

    def _routed(self, pending_request, replica_id) -> None:
        request = self._request(pending_request)
        if request is None:
            return
        chosen = self._chosen.pop(pending_request.metadata.internal_request_id, None)
        inputs, decision = chosen or (affinity_inputs(request, self.block_chars), None)
        keys, session, adapter = inputs
        # time.time(): the clock of the replicas' routing-stats reports ("at")
        self.affinity.record(keys, session, replica_id, adapter, at=time.time())
        if adapter:
            request_id = pending_request.metadata.internal_request_id
            self._completed(request_id)  # routed again (a retry): the first one is over
            self._in_flight[request_id] = (replica_id, adapter)
            while len(self._in_flight) > 100_000:  # completions lost: forget the oldest
                self._completed(next(iter(self._in_flight)))
        if decision is not None:  # None: dropped from the bounded table, counted nowhere
            _decision_counter().inc(1, {"variant": self._variant, "decision": decision})

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._completed(internal_request_id)

    def _completed(self, request_id: str) -> None:
        if (routed := self._in_flight.pop(request_id, None)) is not None:
            self.affinity.completed(*routed)

    def update_replicas(self, replicas) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for rid in gone:
            self.affinity.forget(rid)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
