"""What the mesh's own decisions cost on this host (``bench.py --sim --router-cost``): the
replica-routing decision at 8 to 1,000 replicas with 1,000 adapters resident, admission's
enter + release with up to 20,000 requests queued, and the affinity table's memory at its
bounds. The real code, timed with ``time.perf_counter``; no Ray, no engine."""

from __future__ import annotations

import asyncio
import time

from bench.fleet.virtual_time import run_virtual
from bench.fleet.workloads import many_adapters
from serve_app.admission.variant_queue import ADMIT_MARGIN, VariantAdmission
from serve_app.admission.refusals import Rejected
from serve_app.admission.slots import Slot
from serve_app.observability.stats import percentile


def router_cost(sizes: list[int], adapters: int = 1000, requests: int = 3000) -> list[dict]:
    """The mesh's replica-routing decision (what ``AffinityRouter.choose_replicas`` and
    ``on_request_routed`` run per request: routing stats read, prefix keys, adapter holders,
    the choice, the record), timed with ``time.perf_counter`` on this host, with
    ``adapters`` adapters resident across ``n`` replicas (8 each, spread), for each ``n``."""
    import random
    from types import SimpleNamespace

    from serve_app.replica_routing.affinity import ReplicaAffinity, prefix_keys
    from serve_app.replica_routing.router import rank_replicas

    rng = random.Random(0)
    reqs = many_adapters(100.0, requests / 100.0, adapters=adapters, seed=1)
    rows = []
    for n in sizes:
        replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats={
            "adapters": [f"lora-{(i * 8 + j) % adapters}@v1" for j in range(8)], "at": 0.0,
            "max_loras": 4, "max_num_seqs": 64}) for i in range(n)]
        by_id = {r.replica_id: r for r in replicas}
        affinity = ReplicaAffinity()
        times = []
        for i, req in enumerate(reqs):
            queue_len = {r.replica_id: rng.randrange(8) for r in replicas}
            t0 = time.perf_counter()
            loads = {r.replica_id: queue_len[r.replica_id] for r in replicas}
            keys = prefix_keys(req.text, req.adapter)
            choice = rank_replicas(affinity, keys, None, req.adapter, loads, replicas)
            ranks = [[by_id[rid] for rid in rank] for rank in choice.ranks]
            affinity.record(keys, None, ranks[0][0].replica_id, req.adapter, at=float(i))
            times.append(time.perf_counter() - t0)
        rows.append({"replicas": n, "adapters": adapters,
                     "p50_ms": percentile(times, 50) * 1000,
                     "p99_ms": percentile(times, 99) * 1000})
        print(f"[router cost, this host] {n:>5} replicas, {adapters} adapters resident: "
              f"decision p50 {rows[-1]['p50_ms']:.3f} ms, p99 {rows[-1]['p99_ms']:.3f} ms",
              flush=True)
    return rows


def affinity_table_memory(replicas: int = 1000) -> float:
    """MiB one router's :class:`ReplicaAffinity` holds at its LRU bounds (``MAX_BLOCKS`` block
    keys, ``MAX_SESSIONS`` sessions, ``MAX_ADAPTER_ROUTES`` adapter routes) over ``replicas``
    replicas (tracemalloc)."""
    import tracemalloc

    from serve_app.replica_routing.affinity import (MAX_ADAPTER_ROUTES, MAX_BLOCKS,
                                                    MAX_SESSIONS, ReplicaAffinity)

    tracemalloc.start()
    table = ReplicaAffinity()
    for i in range(MAX_BLOCKS):
        table.record([i.to_bytes(8, "big")], f"s{i}" if i < MAX_SESSIONS else None,
                     i % replicas, f"lora-{i % MAX_ADAPTER_ROUTES}@v1" if i < MAX_ADAPTER_ROUTES
                     else None)
    held = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    print(f"[router memory, this host] the affinity table at its bounds over {replicas} "
          f"replicas: {held:.0f} MiB", flush=True)
    return held


def admission_cost(depths: list[int], tenants_n: int = 8, samples: int = 300) -> list[dict]:
    """The mesh's admission (:class:`VariantAdmission`, token-fair, 8 tenants taking turns,
    64 slots of 1 s as measured at start-up) per request with about ``depth`` requests
    queued: one ``enter`` and one ``release`` (which grants the head of the queue), timed on
    this host, in two queues:

    - ``far``: deadlines far off (``queue_timeout_s`` 1e9, the clock still);
    - ``overloaded`` (``depth`` 100 or more): an overload built on the virtual clock, 80
      requests a second arriving and 50 ending (the engines slower than measured: a request
      holds its slot 1.6 s), ``queue_timeout_s`` set so the queue would stop growing near
      ``depth``; once 0.9 ``depth`` are queued, timed at 50 arrivals and 50 ends a second.
      The oldest requests are then near their deadlines, so shedding checks some of them
      one by one.

    ``far`` queues ``depth`` beyond the 16 of headroom the best priority may also run
    (:data:`~serve_app.admission.variant_queue.HEADROOM`), which a busy tenant may not use.
    """
    rows = []
    for depth in depths:
        for case in ("far", "overloaded") if depth >= 100 else ("far",):
            async def main():
                clock = asyncio.get_running_loop().time
                # overloaded: the queue holds what starts within ADMIT_MARGIN x the timeout,
                # ~63 slots of 1.6 s: ~40 a second
                timeout = 1e9 if case == "far" else depth / 40 / ADMIT_MARGIN
                adm = VariantAdmission("sim", queue_timeout_s=timeout, fairness="tokens",
                                       newcomer_slots=1, clock=clock)
                adm.set_capacity(64, full_batch_service_s=1.0)
                slots, pending, ended = [], [], 0.0
                times: list[float] = []

                def arrive_and_end(i: int, end: bool) -> None:
                    """One arrival (refused or not) and, if ``end``, one end."""
                    nonlocal slots, pending
                    t0 = time.perf_counter()
                    try:
                        ticket = adm.enter(0, True, f"t{i % tenants_n}")
                        (slots if isinstance(ticket, Slot) else pending).append(ticket)
                    except Rejected:
                        pass
                    if end and slots:
                        adm.release(slots.pop(0), 100.0, 1.0)
                    if timing:
                        times.append(time.perf_counter() - t0)
                    slots += [w.future.result() for w in pending
                              if w.future.done() and w.future.exception() is None]
                    pending = [w for w in pending if not w.future.done()]

                timing, i = False, 0
                if case == "far":  # a queue of depth at once, then an end with each arrival
                    while adm.queued < depth + 16:
                        arrive_and_end(i, False)
                        i += 1
                else:  # the overload until the queue is near its bound
                    while adm.queued < 0.9 * depth:
                        if i > 10 * depth:  # it grows ~30 a second, 80 arrivals: ~3 x depth
                            raise RuntimeError(f"admission_cost: the queue stopped at "
                                               f"{adm.queued}, short of 0.9 x {depth}")
                        arrive_and_end(i, ended >= 1)
                        ended = ended % 1 + 50 / 80
                        await asyncio.sleep(1 / 80)
                        i += 1
                queued, timing = adm.queued, True
                for _ in range(samples):
                    i += 1
                    arrive_and_end(i, True)
                    await asyncio.sleep(0.0 if case == "far" else 1 / 50)
                return times, queued, adm.queued

            times, queued, at_end = run_virtual(main())
            rows.append({"queued": queued, "case": case, "queued_at_end": at_end,
                         "p50_ms": percentile(times, 50) * 1000,
                         "p99_ms": percentile(times, 99) * 1000})
            print(f"[admission cost, this host] {queued:>6} queued, {case:<12}: enter + release "
                  f"p50 {rows[-1]['p50_ms']:.3f} ms, p99 {rows[-1]['p99_ms']:.3f} ms "
                  f"({at_end} queued at the end)", flush=True)
    return rows
