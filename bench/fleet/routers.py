"""The replica routers a simulated fleet (:mod:`bench.fleet.fleet`) is measured with.

* ``default``: Serve's ``PowerOfTwoChoicesRequestRouter`` (Ray 2.60): two replicas at random
  among those with room, the one with fewer requests in flight.
* ``multiplex``: Serve's model multiplexing (``@serve.multiplexed`` +
  ``multiplexed_model_id``) for an adapter request: power of two among the replicas that
  hold the adapter, else among those holding the fewest models (Serve falls back at once
  here, not after its 1 s ``multiplexed_model_id`` timeout). Holdings are each replica's
  resident adapters now (Serve pushes a replica's model ids when they change).
* ``affinity``: the mesh's :class:`~serve_app.replica_routing.affinity.ReplicaAffinity`, as
  :class:`~serve_app.replica_routing.router.AffinityRouter` runs it: prefix keys of the
  prompt (:func:`~serve_app.replica_routing.affinity.prefix_keys`), the session, the adapter,
  the replicas' last routing-stats reports (resident adapters, ``max_loras``) and the
  requests in flight; then the least-loaded replica with room in the first rank that has
  one (Serve's rule for a custom router's ranks). ``affinity-no-prefix`` turns prefix and
  session affinity off (no keys, no session), ``affinity-no-adapter`` adapter affinity (no
  adapter, no holders), each alone.

:class:`Replayed` is no policy: it sends each request where a real run sent it (a real
router's placement, put on the simulated fleet to compare the engines under the same one).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from serve_app.replica_routing.affinity import BLOCK_CHARS, ReplicaAffinity, prefix_keys
from bench.fleet.fleet import Fleet, FleetReplica, FleetRequest, Router

ROUTERS = ("default", "multiplex", "affinity", "affinity-no-prefix", "affinity-no-adapter")


class ServeDefault(Router):
    """Serve's default router (see the module docstring)."""

    def __init__(self, fleet: Fleet, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def _two(self, replicas: list[FleetReplica]) -> FleetReplica | None:
        if not replicas:
            return None
        pair = self.rng.sample(replicas, 2) if len(replicas) > 1 else replicas
        return min(pair, key=lambda r: r.in_flight)

    def choose(self, req: FleetRequest, pool: list[FleetReplica]) -> FleetReplica | None:
        return self._two([r for r in pool if r.has_room()])


class ServeMultiplex(ServeDefault):
    """Serve's model multiplexing (see the module docstring)."""

    def choose(self, req: FleetRequest, pool: list[FleetReplica]) -> FleetReplica | None:
        room = [r for r in pool if r.has_room()]
        if req.adapter and room:
            holders = [r for r in room if req.adapter in r.resident]
            if not holders:
                fewest = min(len(r.resident) for r in room)
                holders = [r for r in room if len(r.resident) == fewest]
            room = holders
        return self._two(room)


class MeshAffinity(Router):
    """The mesh's replica router, prefix/session and adapter affinity each on or off;
    ``kwargs``: :class:`ReplicaAffinity`'s bounds (``imbalance_bound``, ...)."""

    def __init__(self, fleet: Fleet, *, prefix: bool = True, adapter: bool = True,
                 block_chars: int = BLOCK_CHARS, **kwargs) -> None:
        self.fleet = fleet
        self.affinity = ReplicaAffinity(**kwargs)
        self.prefix, self.adapter, self.block_chars = prefix, adapter, block_chars
        self.max_loras = {r.index: r.limits.max_loras for r in fleet.pool}
        self.max_num_seqs = {r.index: r.limits.max_num_seqs for r in fleet.pool}

    def choose(self, req: FleetRequest, pool: list[FleetReplica]) -> FleetReplica | None:
        keys = prefix_keys(req.text, req.adapter, self.block_chars) if self.prefix else []
        session = req.session if self.prefix else None
        lora = req.adapter if self.adapter else None
        loads = {r.index: r.in_flight for r in pool}
        holders = self.affinity.adapter_holders(lora, self.fleet.reports)
        choice = self.affinity.choose(keys, session, loads, lora, holders, self.max_loras,
                                      self.max_num_seqs, req.newcomer)
        for rank in choice.ranks:
            room = [pool[i] for i in rank if pool[i].has_room()]
            if room:
                chosen = min(room, key=lambda r: r.in_flight)
                self.affinity.record(keys, session, chosen.index, lora,
                                     at=asyncio.get_running_loop().time())
                return chosen
        return None

    def completed(self, req: FleetRequest, replica: FleetReplica) -> None:
        if self.adapter and req.adapter:
            self.affinity.completed(replica.index, req.adapter)


class Replayed(Router):
    """Each request to the replica ``place(request)`` (its index in the pool), waiting while
    that one has no room or already runs ``max_in_flight`` requests: a real run's placement
    replayed (see the module docstring). The real run's timing placed each request where a
    slot had just come free; on the simulated clock the slots free in another order, so
    without ``max_in_flight`` (the most the real router let a replica run) a replay piles
    requests on one replica that the real run never did."""

    def __init__(self, place: Callable[[FleetRequest], int],
                 max_in_flight: int | None = None) -> None:
        self.place, self.max_in_flight = place, max_in_flight

    def choose(self, req: FleetRequest, pool: list[FleetReplica]) -> FleetReplica | None:
        replica = pool[self.place(req)]
        if self.max_in_flight is not None and replica.in_flight >= self.max_in_flight:
            return None
        return replica if replica.has_room() else None


def make_router(name: str, seed: int = 0, block_chars: int = BLOCK_CHARS, **bounds):
    """A factory ``fleet -> router`` for the router called ``name`` (:data:`ROUTERS`);
    ``bounds``: :class:`ReplicaAffinity`'s (``adapter_imbalance_bound``, ...) for the mesh's
    router (Serve's routers have none).

    Raises:
        ValueError: an unknown name.
    """
    if name == "default":
        return lambda fleet: ServeDefault(fleet, seed)
    if name == "multiplex":
        return lambda fleet: ServeMultiplex(fleet, seed)
    flags = {"affinity": {}, "affinity-no-prefix": {"prefix": False},
             "affinity-no-adapter": {"adapter": False}}
    if name in flags:
        return lambda fleet: MeshAffinity(fleet, block_chars=block_chars, **flags[name],
                                          **bounds)
    raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
