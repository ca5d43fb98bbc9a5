"""How far to trust the fleet simulation (``bench.py --sim --trust``): real runs of this host's
benchmarks (:data:`RUNS_FILE`, their figures as measured) replayed on the simulated fleet,
each beside its real figures with the error (sim / real - 1)."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.fleet.fleet import EngineLimits
from bench.fleet.routers import Replayed
from bench.fleet.runs import simulate, summarize
from bench.fleet.workloads import ClosedLoop, SessionQueue
from serve_app.observability.stats import percentile
from serve_app.common.sim_profile import load_profile

#: The real runs and where they come from (commands, dates, the host's reference run).
RUNS_FILE = Path(__file__).resolve().parent / "data" / "trust_runs.yaml"
#: Engine limits of the real runs :data:`TRUST_RUNS` replays (serve_configs/affinity.yaml's
#: smollm-v1, and vLLM's own server started with the same args).
AFFINITY_LIMITS = EngineLimits(max_num_seqs=8, max_loras=2, max_cpu_loras=4,
                               max_num_batched_tokens=2048, max_ongoing_requests=64)
K16 = tuple(f"copy-{i}@v1" for i in range(16))


@dataclass(frozen=True)
class TrustRun:
    """A run of real vLLM on this host (docs/benchmarks.md), on the same day as the profile's
    calibration (the host's speed moves 3-4x from day to day): where it ran (``direct``:
    vLLM's own server, one engine, no mesh; ``mesh``: through the mesh, whose processes
    share the 2 cores with the engines), replicas, the replica router, the load, the real
    tokens/s, TTFT p50 (s), the cores each engine's workers got during the run (``busy
    engines x worker cores each`` in the benchmark's table:
    :class:`~bench.host_cpu.EngineShare`), the prefix-cache hit rate (None: not
    a prefix load) and, for a sessions run, the replica each turn went to (``placement``, as
    ``bench.py --sessions`` prints it: a digit a turn, a group a session), which the replay
    follows when ``replay_placement`` (:class:`~bench.fleet.routers.Replayed`, each
    replica running at most its share of the requests in flight: the most Serve's default
    router lets one run when it sends each request to the less loaded; assumed, the benchmark
    does not record it), else it routes with ``router``."""

    name: str
    source: str
    where: str
    replicas: int
    router: str
    load: Callable[[], object]
    tokens_per_s: float
    ttft_p50_s: float
    worker_cores: float
    hit_rate: float | None = None
    placement: str | None = None
    replay_placement: bool = False

    def __post_init__(self) -> None:
        if self.worker_cores <= 0:
            raise ValueError(f"TrustRun {self.name!r}: worker_cores must be > 0 (the cores the "
                             "run's engine workers got, from its table); 0 means no vLLM "
                             "engine was measured")
        digits = set(self.placement or "") - {" "}
        if not digits <= set("0123456789"[:self.replicas]):
            raise ValueError(f"TrustRun {self.name!r}: placement has {sorted(digits)}; it "
                             f"holds replica indexes below {self.replicas}, as bench.py "
                             "--sessions prints them (a turn it lost, '?', cannot be replayed)")
        if self.replay_placement and not self.placement:
            raise ValueError(f"TrustRun {self.name!r}: replay_placement needs the placement")

    def router_for(self, work) -> str | Callable:
        """The replay's router for one seed's ``work`` (a :class:`SessionQueue` when the run
        replays its placement).

        Raises:
            ValueError: the placement's sessions and turns are not the load's.
        """
        if not self.replay_placement:
            return self.router
        sessions = self.placement.split()
        if [len(turns) for turns in sessions] != [len(p) for p in work.prompts]:
            raise ValueError(f"TrustRun {self.name!r}: the placement has sessions of "
                             f"{[len(t) for t in sessions]} turns, the load "
                             f"{[len(p) for p in work.prompts]}")
        share = math.ceil(work.in_flight / self.replicas)
        return lambda fleet: Replayed(lambda req: int(
            sessions[int(req.session[1:])][work.turn(req)]), max_in_flight=share)


def base_only():
    return ClosedLoop(48, 8, 35, 32)  # the run's 8 warm-up requests before it are not replayed


def k16():
    return ClosedLoop(48, 8, 35, 32, K16)


def sessions():
    return SessionQueue(session_prompts(), 4, 16)


#: The loads a run of :data:`RUNS_FILE` names.
LOADS: dict[str, Callable[[], object]] = {"base_only": base_only, "k16": k16,
                                          "sessions": sessions}


def load_runs(path: Path = RUNS_FILE) -> tuple[list[TrustRun], str]:
    """The runs of ``path`` (the adapters runs, then each sessions run three ways: affinity,
    the default router, and the default router's placement replayed) and the name of the
    host's reference run."""
    data = yaml.safe_load(path.read_text())
    runs = [TrustRun(source=data["adapters_command"], **{**run, "load": LOADS[run["load"]]})
            for run in data["adapters_runs"]]
    for run in data["sessions_runs"]:
        for router, replayed in (("affinity", False), ("default", False), ("default", True)):
            runs.append(TrustRun(
                f"sessions {run['at']}, {router}{', its placement replayed' * replayed}",
                data["sessions_command"].format(run["at"]), "mesh", 2, router, sessions,
                **run[router], replay_placement=replayed))
    return runs, data["host_reference"]


TRUST_RUNS, HOST_REFERENCE = load_runs()
#: This host's profile fitted within the hour of :data:`TRUST_RUNS` (the shipped
#: ``cpu-smollm2``, that the sim tier's tests are built on, is of a day when the host ran
#: 2-3x slower).
TRUST_PROFILE = "cpu-smollm2-trust"
#: Seeds of each replay (Serve's default router picks at random, engine steps vary); the
#: figures are their medians, with their range.
TRUST_SEEDS = tuple(range(8))


@functools.cache
def session_prompts() -> list[list[tuple[int, ...]]]:
    """SESSIONS_CMD's prompts, token by token as that run sent them (its chat template and
    tokenizer: ~1,500 tokens a first turn, 21 more a turn)."""
    from bench import sessions as bench_sessions
    from serve_app.common.serve_configs import load_yaml

    tokenizer = bench_sessions.tokenizer_of(load_yaml(bench_sessions.CONFIG))
    return bench_sessions.prompt_token_ids(tokenizer, sessions=24, turns=4,
                                           prefix_tokens=1500, tenants=4)


def same_replica_share(sessions: list[list]) -> float | None:
    """Of the sessions' turns after their first, the share that went to the replica of the
    turn before (``sessions``: each one's replicas, turn by turn; None: no second turn)."""
    pairs = [(a, b) for turns in sessions for a, b in zip(turns, turns[1:])]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def replay(run: TrustRun, scale: float) -> dict[str, tuple[float, float, float]]:
    """``run`` on the sim (:data:`TRUST_PROFILE`, every duration x ``scale``) once for each
    of :data:`TRUST_SEEDS`: the (median, least, most) of its tokens/s, TTFT p50 s (sessions:
    over the turns after the first, as that benchmark reports), prefix-cache hit rate and,
    for sessions, :func:`same_replica_share`; for a replayed placement, also the TTFT p50
    from the request's routing on (``ttft_p50_routed_s``)."""
    profile = load_profile(TRUST_PROFILE).scaled(scale)
    figures = []
    for seed in TRUST_SEEDS:
        work = run.load()
        served, fleet = simulate(profile, run.replicas, AFFINITY_LIMITS, run.router_for(work),
                                 work.requests(), work.follow_up, seed=seed)
        later = [r for r in served if not isinstance(work, SessionQueue) or work.turn(r)]
        whole = summarize(served, fleet, 0.0)  # every request arrives from 0 s on
        figures.append({"tokens_per_s": whole["tokens_per_s"],
                        "ttft_p50_s": percentile([r.ttft_s for r in later], 50),
                        "hit_rate": whole["prefix_hit_rate"]})
        if run.replay_placement:  # without the wait for the placed replica, which the real
            # run did not have: its timing freed that replica's slot as the request came
            figures[-1]["ttft_p50_routed_s"] = percentile(
                [r.first_token_at - r.routed_at for r in later], 50)
        if isinstance(work, SessionQueue):
            turns: dict[str, dict[int, int]] = {}
            for r in served:
                turns.setdefault(r.session, {})[work.turn(r)] = r.replica
            if (same := same_replica_share([[t[i] for i in sorted(t)]
                                            for t in turns.values()])) is not None:
                figures[-1]["same_replica"] = same
    return {k: (statistics.median(v), min(v), max(v))
            for k in figures[0] for v in [[f[k] for f in figures]]}


def trust() -> list[dict]:
    """Each run of :data:`TRUST_RUNS` on the sim beside the real figures, with each one's
    error (sim / real - 1). A run's every duration is x its time scale: the cores
    :data:`HOST_REFERENCE`'s engine workers got / those each of the run's engines' workers
    got (the mesh's processes and a second engine take theirs from the same 2 cores; the
    profile is of one engine alone). Read off the run's processes, not fitted to its
    tokens/s."""
    reference = next(r for r in TRUST_RUNS if r.name == HOST_REFERENCE)
    rows = []
    for run in TRUST_RUNS:
        scale = reference.worker_cores / run.worker_cores
        sim = replay(run, scale)
        row = {"run": run.name, "source": run.source, "where": run.where,
               "router": run.router, "placement_replayed": run.replay_placement,
               "worker_cores": run.worker_cores, "time_scale": round(scale, 3)}
        same = same_replica_share([list(t) for t in (run.placement or "").split()])
        same = None if same is None else round(same, 3)
        for key, real in (("tokens_per_s", run.tokens_per_s), ("ttft_p50_s", run.ttft_p50_s),
                          ("ttft_p50_routed_s", run.ttft_p50_s), ("hit_rate", run.hit_rate),
                          ("same_replica", same)):
            if real is not None and key in sim:  # routed: a replayed placement's only
                median, least, most = sim[key]
                row[key] = {"real": real, "sim": round(median, 3),
                            "sim_range": [round(least, 3), round(most, 3)],
                            "error": round(median / real - 1, 3) if real else None}
        rows.append(row)

        def shown(key: str, unit: str = "") -> str:
            f = row[key]
            error = "" if f["error"] is None else f"{f['error']:+.0%}; "
            return (f"real {f['real']:.2f}{unit} sim {f['sim']:.2f}{unit} ({error}"
                    f"seeds {f['sim_range'][0]:.2f}-{f['sim_range'][1]:.2f})")
        hits = f"; hit rate {shown('hit_rate')}" if run.hit_rate is not None else ""
        if same is not None:
            hits += f"; a next turn on its last turn's replica {shown('same_replica')}"
        if "ttft_p50_routed_s" in row:
            hits += (f"; TTFT p50 from its routing on (the replay's wait for the placed "
                     f"replica left out) {shown('ttft_p50_routed_s', ' s')}")
        print(f"[trust, {TRUST_PROFILE} x{scale:.2f}] {run.name}: tokens/s "
              f"{shown('tokens_per_s')}; TTFT p50 {shown('ttft_p50_s', ' s')}{hits}",
              flush=True)
    return rows
