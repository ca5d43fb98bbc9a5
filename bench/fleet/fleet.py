"""A fleet of simulated engines behind one router, on a virtual clock: the mesh at a scale one
host cannot hold (32+ replicas, 1,000 adapters), for ``scripts/bench.py --sim``.

What runs is the mesh's own code wherever it decides something: each replica's engine is
the simulated engine's :class:`~serve_app.sim.scheduler.SimScheduler` priced by a
:class:`~serve_app.common.sim_profile.SimProfile` (continuous batching, ``max_num_seqs``,
``max_loras``, the prefix cache); the replica router is the mesh's
:class:`~serve_app.replica_routing.affinity.ReplicaAffinity` fed what
:class:`~serve_app.replica_routing.router.AffinityRouter` feeds it; admission is the mesh's
:class:`~serve_app.admission.variant_queue.VariantAdmission`. Around them, this module stands in
for what Serve and vLLM do (:mod:`bench.fleet.routers` for Serve's routers):

* a replica takes at most ``max_ongoing_requests``; when every replica is full a request
  waits in the router, first come first routed (Serve's ``FIFOMixin``);
* a request for an adapter the replica does not hold loads it first (``adapter_load_s``;
  one load per adapter at a time, shared by the requests that wait on it), evicting the
  least recently used idle adapter past ``max_cpu_loras`` (vLLM's LRU adapter cache); the
  load does not stop the engine's steps, as in the simulated engine;
* replicas report their resident adapters every ``stats_period_s`` (Serve's routing
  stats, ``request_routing_stats_period_s``).

Not simulated: HTTP, Serve's proxy and handle calls (no cost, no delay), several router
replicas (one router sees exact loads), replica start-up and failures. So the figures are
the policies' effect on engines, not the router's own cost (``bench.py --sim`` measures
that apart, on the real decision code).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from serve_app.admission.variant_queue import VariantAdmission
from serve_app.admission.fair_share import service_cost
from serve_app.admission.service_time import request_size
from serve_app.admission.refusals import Rejected
from serve_app.admission.slots import Counted
from serve_app.common.sim_profile import SimProfile
from serve_app.sim.scheduler import SimRequest, SimScheduler, evict_idle_lru


@dataclass
class FleetRequest:
    """One request of a workload (times in virtual s since the run began).

    ``text``: what the replica router hashes for prefix affinity (the prompt as text);
    ``adapter``: ``name@vN`` or None for the base model; ``session``: ``x-session-id``;
    ``tenant``: for admission ("" when the run has none)."""

    arrival: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    text: str = ""
    adapter: str | None = None
    session: str | None = None
    tenant: str = ""
    # filled in by the fleet
    replica: int = -1
    routed_at: float | None = None  # when it left the router (admission and routing done)
    first_token_at: float | None = None
    done_at: float | None = None
    generated: int = 0
    output_ids: tuple[int, ...] = ()  # what it generated, once done
    cached_tokens: int = 0
    loaded_adapter: bool = False
    newcomer: bool = False  # admission started it in a newcomer slot (Slot.newcomer)
    rejected: str | None = None  # admission's reason (``Rejected.reason``)
    refused_at: float | None = None  # when admission refused it
    on_token: Callable[[], None] | None = None  # the router relays each token (a stream)

    def fresh(self) -> FleetRequest:
        """This request as a workload gave it, without what a run filled in."""
        return FleetRequest(self.arrival, self.prompt_ids, self.max_tokens, self.text,
                            self.adapter, self.session, self.tenant)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, s (None below 2 tokens)."""
        if self.done_at is None or self.first_token_at is None or self.generated < 2:
            return None
        return (self.done_at - self.first_token_at) / (self.generated - 1)


class _Book:
    """Answers without words: the fleet needs a token's time, not its id (the engine's
    :class:`~serve_app.sim.answers.AnswerBook` hashes every word)."""

    words = (0,)

    def answer(self, label: str, prompt_ids) -> list[int]:
        return [0]

    def token_at(self, label: str, prompt_ids, i: int) -> int:
        return 0


@dataclass
class EngineLimits:
    """One replica's vLLM engine arguments and Serve's cap on it."""

    max_num_seqs: int = 64
    max_loras: int = 4
    max_cpu_loras: int = 8
    max_model_len: int = 8192
    max_num_batched_tokens: int = 8192
    max_ongoing_requests: int = 64


class FleetReplica:
    """One simulated replica: an engine step loop and its adapter cache."""

    def __init__(self, index: int, profile: SimProfile, limits: EngineLimits,
                 seed: int = 0) -> None:
        self.index = index
        self.profile = profile
        self.limits = limits
        self.scheduler = SimScheduler(
            profile, _Book(), max_num_seqs=limits.max_num_seqs, max_loras=limits.max_loras,
            max_model_len=limits.max_model_len,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            step_jitter=random.Random(f"{seed}/{index}"))
        self.in_flight = 0
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter -> lora_int_id, LRU
        self.loads = 0
        self._loading: dict[str, asyncio.Future] = {}
        self._requests: dict[str, tuple[FleetRequest, asyncio.Future]] = {}
        self._work = asyncio.Event()
        self._ids: dict[str, int] = {}
        self.task = asyncio.get_running_loop().create_task(self._run())

    def has_room(self) -> bool:
        return self.in_flight < self.limits.max_ongoing_requests

    def adapters_in_use(self) -> set[str]:
        """Adapters a request waiting or running in the engine uses."""
        ids = self.scheduler.loras_in_use()
        return {name for name, i in self.resident.items() if i in ids}

    def report(self) -> list[str]:
        """The resident adapters (what ``LLMReplica.record_routing_stats`` reports)."""
        return list(self.resident)

    async def serve(self, req: FleetRequest, request_id: str) -> None:
        """Run ``req`` to its last token (fills its times, tokens and cache hits), in the
        slot the router took for it (``in_flight`` was raised; this gives it back)."""
        try:
            lora = await self._adapter(req) if req.adapter else 0
            done = asyncio.get_running_loop().create_future()
            self._requests[request_id] = (req, done)
            self.scheduler.add(SimRequest(
                request_id=request_id, prompt_ids=req.prompt_ids, max_tokens=req.max_tokens,
                label="", lora=lora, lora_name=req.adapter or "", eos=None,
                arrival=asyncio.get_running_loop().time()))
            self._work.set()
            await done
        finally:
            self.in_flight -= 1

    async def _adapter(self, req: FleetRequest) -> int:
        name = req.adapter
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        if name not in self._loading:  # one load per adapter; later requests wait on it
            self._loading[name] = asyncio.get_running_loop().create_future()
            req.loaded_adapter = True
            self.loads += 1
            await asyncio.sleep(self.profile.adapter_load_s)
            evict_idle_lru(self.resident, self.limits.max_cpu_loras - 1,
                           self.adapters_in_use())
            self.resident[name] = self._ids.setdefault(name, len(self._ids) + 1)
            self._loading.pop(name).set_result(None)
        else:
            await self._loading[name]
        self.resident.move_to_end(name)
        return self.resident[name]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        while True:
            if not sched.has_work():
                self._work.clear()
                await self._work.wait()
                continue
            step = sched.plan(loop.time())
            await asyncio.sleep(step.seconds)
            now = loop.time()
            for token in sched.finish(step):
                req, done = self._requests[token.request.request_id]
                req.generated += 1
                if req.on_token is not None:
                    req.on_token()
                if token.first:
                    req.first_token_at = now
                    req.cached_tokens = token.request.cached_tokens
                if token.finish:
                    req.done_at = now
                    req.output_ids = tuple(token.request.output_ids)
                    del self._requests[token.request.request_id]
                    done.set_result(None)


class Router:
    """A replica router of the fleet (:mod:`bench.fleet.routers` has them)."""

    def choose(self, req: FleetRequest, pool: list[FleetReplica]) -> FleetReplica | None:
        """The replica ``req`` goes to (its slot is then taken), or None when none has room
        (it waits and is offered again when a replica frees a slot)."""
        raise NotImplementedError

    def completed(self, req: FleetRequest, replica: FleetReplica) -> None:
        """``req``, routed to ``replica``, has completed."""


@dataclass
class Fleet:
    """``replicas`` simulated replicas of one variant behind one router.

    Args:
        profile: the engines' cost model.
        replicas: how many.
        limits: each engine's limits.
        stats_period_s: how often replicas report resident adapters, s.
        admission: the mesh's admission in front (None: no admission; requests wait in the
            router until a replica has room).
        seed: seeds each engine's step times (the profile's ``step_time_cv``).
    """

    profile: SimProfile
    replicas: int
    limits: EngineLimits = field(default_factory=EngineLimits)
    stats_period_s: float = 2.0
    admission: VariantAdmission | None = None
    seed: int = 0

    async def run(self, requests: list[FleetRequest], route_with: Callable[[Fleet], Router],
                  follow_up: Callable[[FleetRequest], FleetRequest | None] | None = None
                  ) -> list[FleetRequest]:
        """Serve ``requests`` (each from its ``arrival``) and, for each that finishes,
        ``follow_up(request)`` (a session's next turn, or None); returns every request
        served or rejected (copies: ``requests`` are not changed), in arrival order.
        ``route_with(fleet)`` makes the router once
        the replicas exist (it may read :attr:`pool` and :attr:`reports`)."""
        loop = asyncio.get_running_loop()
        self.pool = [FleetReplica(i, self.profile, self.limits, self.seed)
                     for i in range(self.replicas)]
        self.reports: dict[int, tuple[list[str], float]] = {}
        self.adapters_in_flight: list[tuple[float, int, int]] = []
        self._report()
        router = route_with(self)
        self._pending: list[tuple[FleetRequest, asyncio.Future]] = []
        done: list[FleetRequest] = []
        tasks: set[asyncio.Task] = set()
        ids = itertools.count()

        async def one(req: FleetRequest) -> None:
            await asyncio.sleep(max(0.0, req.arrival - loop.time()))
            await self._serve(req, router, str(next(ids)))
            done.append(req)
            nxt = follow_up(req) if follow_up and req.rejected is None else None
            if nxt is not None:
                start(nxt)

        def start(req: FleetRequest) -> None:
            task = loop.create_task(one(req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        reporter = loop.create_task(self._reporting())
        for req in requests:
            start(req.fresh())
        while tasks:
            await asyncio.gather(*list(tasks))
        reporter.cancel()
        for r in self.pool:
            r.task.cancel()
        return sorted(done, key=lambda r: r.arrival)

    async def _serve(self, req: FleetRequest, router: Router, request_id: str) -> None:
        slot = None
        if self.admission is not None:
            try:
                slot = await self.admission.acquire(
                    0, True, req.tenant, request_size(req.max_tokens),
                    Counted(service_cost(len(req.prompt_ids), 0)))  # a stream
            except Rejected as e:
                req.rejected, req.refused_at = e.reason, asyncio.get_running_loop().time()
                return
            req.on_token = lambda: self.admission.served(slot, service_cost(0, 1))
            req.newcomer = slot.newcomer
        try:
            replica = self._take(router, req)
            if replica is None:  # every replica is full: wait for one, first come first
                waiter = asyncio.get_running_loop().create_future()
                self._pending.append((req, waiter))
                replica = await waiter
            req.replica = replica.index
            req.routed_at = asyncio.get_running_loop().time()
            try:
                await replica.serve(req, request_id)
            finally:
                router.completed(req, replica)
        finally:
            if slot is not None:
                self.admission.release(slot, service_cost(len(req.prompt_ids), req.generated),
                                       request_size(req.generated) if req.generated else None)
            self._route_pending(router)

    def _take(self, router: Router, req: FleetRequest) -> FleetReplica | None:
        """The replica ``router`` chooses for ``req``, with its slot taken (None: none has
        room)."""
        replica = router.choose(req, self.pool)
        if replica is not None:
            replica.in_flight += 1
        return replica

    def _route_pending(self, router: Router) -> None:
        while self._pending:
            req, waiter = self._pending[0]
            replica = self._take(router, req)  # taken now, before the waiter runs
            if replica is None:
                return
            self._pending.pop(0)
            waiter.set_result(replica)

    def _report(self) -> None:
        now = asyncio.get_running_loop().time()
        self.reports = {r.index: (r.report(), now) for r in self.pool}
        # (when, adapters with a request in an engine summed over the replicas, distinct)
        held = [r.adapters_in_use() for r in self.pool]
        self.adapters_in_flight.append((now, sum(map(len, held)), len(set().union(*held))))

    async def _reporting(self) -> None:
        while True:
            await asyncio.sleep(self.stats_period_s)
            self._report()


