"""The simulated fleet of ``bench.py --sim`` (bench/fleet/: fleet.py, routers.py,
workloads.py, virtual_time.py): exact times on a virtual clock, Serve's routers as the
baseline, and one smoke run of the benchmark at small size. No Ray, no engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter

import pytest

from serve_app.admission.variant_queue import VariantAdmission
from serve_app.observability.stats import percentile
from bench.fleet.fleet import EngineLimits, Fleet, FleetRequest
from bench.fleet.routers import MeshAffinity, make_router
from serve_app.common.sim_profile import load_profile
from bench.fleet.virtual_time import run_virtual
from bench.fleet.workloads import (ClosedLoop, SessionQueue, Sessions, many_adapters,
                                   reachable_hit_rate, tenants)
from serve_app.common.paths import REPO_ROOT
from serve_app.common.wire import CALIBRATION_TOKENS

H100 = load_profile("h100-llama3-8b")
CPU = load_profile("cpu-smollm2").scaled(0.25)  # as the integration tests run it
LIMITS = EngineLimits(max_num_seqs=8, max_ongoing_requests=10)  # smollm-v1 in the configs


def serve(requests, replicas=1, router="default", limits=None, follow_up=None):
    async def main():
        fleet = Fleet(H100, replicas, limits or EngineLimits())
        route = make_router(router) if isinstance(router, str) else router
        return await fleet.run(requests, route, follow_up), fleet
    return run_virtual(main())


def test_virtual_time_jumps_to_each_timer_and_a_deadlock_raises():
    async def sleeps():
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(3600), asyncio.sleep(0.25))
        return loop.time()

    assert run_virtual(sleeps()) == pytest.approx(3600)

    async def stuck():
        await asyncio.Event().wait()

    with pytest.raises(RuntimeError, match="deadlock"):
        run_virtual(stuck())


def test_a_request_on_an_idle_replica_takes_its_prefill_step_then_one_decode_step_a_token():
    [r], _ = serve([FleetRequest(1.0, tuple(range(256)), 4)])
    first = H100.step_s(batch=1, prefill_tokens=256, adapters=0, prefill_lengths=[256])
    assert r.ttft_s == pytest.approx(first)
    assert r.generated == 4
    assert r.tpot_s == pytest.approx(H100.decode_s(1))


def test_past_max_ongoing_requests_a_request_waits_in_the_router_until_a_slot_frees():
    limits = EngineLimits(max_ongoing_requests=2)
    reqs = [FleetRequest(0.0, (i,) * 32, 8) for i in range(3)]
    done, _ = serve(reqs, limits=limits)
    first_two_done = max(r.done_at for r in done[:2])
    assert done[2].first_token_at > first_two_done - 1e-9
    assert all(r.ttft_s < done[2].ttft_s for r in done[:2])


def test_requests_that_wait_on_one_adapter_load_share_it():
    reqs = [FleetRequest(0.0, (i,) * 32, 4, adapter="a@v1") for i in range(3)]
    done, fleet = serve(reqs)
    assert fleet.pool[0].loads == 1 and sum(r.loaded_adapter for r in done) == 1
    assert all(r.ttft_s >= H100.adapter_load_s for r in done)


def test_workloads_are_seeded_and_sessions_grow_their_history():
    a = many_adapters(50, 10, adapters=100, seed=3)
    b = many_adapters(50, 10, adapters=100, seed=3)
    assert [(r.arrival, r.adapter) for r in a] == [(r.arrival, r.adapter) for r in b]
    popular = sum(r.adapter == "lora-0@v1" for r in a) / len(a)
    assert popular > 0.1  # Zipf s=1 over 100: the first is asked for ~19 % of the time
    s = Sessions(2.0, 10.0, turns=(3, 3))
    firsts = s.requests()
    done, _ = serve(firsts, replicas=2, follow_up=s.follow_up)
    assert len(done) == 3 * len(firsts)
    conv = [r for r in done if r.session == firsts[0].session]
    # each turn resends the last prompt, its answer and a new user message of 64 tokens
    assert len(conv[0].prompt_ids) == 512 + 64
    for last, turn in zip(conv, conv[1:]):
        assert turn.prompt_ids[:len(last.prompt_ids)] == last.prompt_ids
        assert len(turn.prompt_ids) == len(last.prompt_ids) + last.generated + 64
    assert 0.5 < reachable_hit_rate(done, H100.block_size) < 1


def test_a_next_turn_resends_the_answer_and_finds_it_cached_with_the_prompt():
    """As vLLM caches a sequence's blocks generated tokens included, a conversation's next
    turn (prompt, answer, new message) finds the answer cached on the replica that wrote it,
    and the reachable hit rate counts it; requests before ``measured_from`` fill the cache
    but are not counted."""
    s = Sessions(1.0, 4.0, turns=(2, 2), seed=5)
    firsts = s.requests()[:1]
    done, _ = serve(firsts, follow_up=s.follow_up)
    first, second = sorted(done, key=lambda r: r.arrival)
    assert len(first.output_ids) == first.generated
    assert second.prompt_ids[:len(first.prompt_ids) + first.generated] == (
        first.prompt_ids + first.output_ids)
    computed = len(first.prompt_ids) + first.generated - 1  # the last token has no KV
    assert second.cached_tokens == computed // H100.block_size * H100.block_size
    assert reachable_hit_rate(done, H100.block_size, measured_from=second.arrival) == (
        second.cached_tokens / len(second.prompt_ids))


def test_a_session_queue_replays_its_prompts_turn_by_turn_first_come_first_served():
    """bench.py --sessions' load: 3 sessions of 2 turns, 2 in flight; a session that ends a
    turn queues its next behind the sessions waiting."""
    prompts = [[tuple(range(s, s + 40)), tuple(range(s, s + 60))] for s in (0, 100, 200)]
    load = SessionQueue(prompts, in_flight=2, max_tokens=4)
    first = load.requests()
    assert [r.prompt_ids for r in first] == [prompts[0][0], prompts[1][0]]
    done, _ = serve(first, follow_up=load.follow_up)
    assert sorted(r.prompt_ids for r in done) == sorted(p for s in prompts for p in s)
    assert [load.turn(r) for r in done].count(1) == 3
    order = [(r.session, load.turn(r)) for r in sorted(done, key=lambda r: r.arrival)]
    assert order.index(("s2", 0)) < order.index(("s0", 1))  # s2 waited first


def test_the_sessions_replay_is_the_token_ids_bench_sessions_sends():
    """``--trust`` replays bench.py --sessions' chats as the model's chat template renders
    them: each turn's prompt extends the last (the prefix a cache can serve), and a
    tenant's sessions share the leading block of its system prompt."""
    from bench import sessions as bench_sessions
    from bench.tokenizer import hf_tokenizer

    prompts = bench_sessions.prompt_token_ids(hf_tokenizer("smollm2-135m-instruct"),
                                              sessions=3, turns=3, prefix_tokens=1500,
                                              tenants=2)
    for turns in prompts:
        assert 1450 < len(turns[0]) < 1550  # --prefix-tokens 1500, and the chat template
        for last, nxt in zip(turns, turns[1:]):
            assert nxt[:len(last)] == last and 15 < len(nxt) - len(last) < 30
    block = 128  # the profile's block_size
    assert prompts[0][0][:block] == prompts[2][0][:block] != prompts[1][0][:block]


def test_bench_sessions_records_where_and_when_each_turn_ran():
    """What ``bench.py --sessions`` prints for ``--trust`` to replay (a digit a turn, a group
    a session, replicas by their sorted ids; a turn no replica answered is '?') and what its
    ``--json`` traces (each request in the order sent, times from the first send)."""
    from bench import sessions as bench_sessions

    results = [{"session": 1, "turn": 0, "replica": "r-a", "sent_at": 100.5, "ttft_s": None,
                "done_at": 101.0},
               {"session": 0, "turn": 1, "replica": "r-b", "sent_at": 102.0, "ttft_s": 0.5,
                "done_at": 103.0},
               {"session": 0, "turn": 0, "replica": "r-b", "sent_at": 100.0, "ttft_s": 1.0,
                "done_at": 101.5},
               {"session": 1, "turn": 1, "replica": None, "sent_at": 101.0, "ttft_s": None,
                "done_at": 101.2}]
    replicas = {"r-b", "r-a"}
    requests = bench_sessions.trace(results, replicas)
    assert bench_sessions.placement(requests) == "11 0?"
    assert [(t["session"], t["turn"], t["replica"], t["sent_s"], t["first_token_s"],
             t["done_s"]) for t in requests] == [
        (0, 0, 1, 0.0, 1.0, 1.5), (1, 0, 0, 0.5, None, 1.0), (1, 1, None, 1.0, None, 1.2),
        (0, 1, 1, 2.0, 2.5, 3.0)]


def test_a_replayed_placement_sends_each_turn_where_the_real_run_sent_it():
    """``--trust`` puts a real run's placement on the fleet: each session's turns go to the
    replicas its placement names (bench.py --sessions prints it), each replica running at most its
    share of the requests in flight; a placement naming a replica the run did not have, a
    lost turn or the wrong shape is refused."""
    from bench.trust import TrustRun

    prompts = [[tuple(range(s, s + 40)), tuple(range(s, s + 60))] for s in (0, 100, 200)]
    run = TrustRun("replayed", "test", "mesh", 2, "default", None, 1.0, 1.0, 1.0,
                   placement="00 01 11", replay_placement=True)
    load = SessionQueue(prompts, in_flight=3, max_tokens=4)
    done, _ = serve(load.requests(), replicas=2, router=run.router_for(load),
                    follow_up=load.follow_up)
    assert sorted((r.session, load.turn(r), r.replica) for r in done) == [
        ("s0", 0, 0), ("s0", 1, 0), ("s1", 0, 0), ("s1", 1, 1), ("s2", 0, 1), ("s2", 1, 1)]
    # at most 1 in flight a replica (2 in flight over 2 replicas, as Serve's default router
    # kept them): s1's first turn waits on replica 0 for s0's, though replica 1 is idle
    run = TrustRun("replayed", "test", "mesh", 2, "default", None, 1.0, 1.0, 1.0,
                   placement="00 01 11", replay_placement=True)
    load = SessionQueue(prompts, in_flight=2, max_tokens=4)
    done, _ = serve(load.requests(), replicas=2, router=run.router_for(load),
                    follow_up=load.follow_up)
    turn = {(r.session, load.turn(r)): r for r in done}
    assert turn["s1", 0].replica == 0 and turn["s1", 0].routed_at >= turn["s0", 0].done_at
    assert turn["s1", 0].ttft_s > turn["s1", 0].first_token_at - turn["s1", 0].routed_at
    for bad in ({"placement": "00 02 11"}, {"placement": "00 0? 11"},
                {"replay_placement": True}):
        with pytest.raises(ValueError, match="placement"):
            TrustRun("bad", "test", "mesh", 2, "default", None, 1.0, 1.0, 1.0, **bad)
    short = TrustRun("short", "test", "mesh", 2, "default", None, 1.0, 1.0, 1.0,
                     placement="00 01 1", replay_placement=True)
    with pytest.raises(ValueError, match="placement has sessions of"):
        short.router_for(load)


def test_the_adapters_in_flight_a_rate_keeps_is_little_s_law_per_adapter():
    """bench.py's estimate for the many-adapters goal: with every request for its own
    adapter it is rate x a request's time (Little's law); with one adapter, one; and on the
    GPU profile, with the load even, 2x the default router's goodput (268/s) keeps more
    distinct adapters in flight than 32 replicas x max_loras 4 can batch, 250/s about as many
    (docs/scale.md)."""
    from bench.scale import adapters_in_flight_needed

    gpu, limits = load_profile("h100-llama3-8b"), EngineLimits(max_loras=4)
    step = gpu.step_s(batch=1, prefill_tokens=0, adapters=4)
    d = gpu.step_s(batch=1, prefill_tokens=256, adapters=4) - step + 128 * step
    rare = adapters_in_flight_needed(gpu, 32, limits, 1.0, [1.0] * 100_000, 256, 128)
    assert rare == pytest.approx(1.0 * d, rel=1e-3)
    assert adapters_in_flight_needed(gpu, 32, limits, 50.0, [1.0], 256, 128) == \
        pytest.approx(1.0)
    zipf = [1 / (k + 1) for k in range(1000)]
    at = {rate: adapters_in_flight_needed(gpu, 32, limits, rate, zipf, 256, 128)
          for rate in (250.0, 268.0)}
    assert 128 < at[250.0] < 132 and 136 < at[268.0] < 140, at


def test_a_fleet_draws_step_times_around_the_profile_by_its_seed():
    """With the profile's step_time_cv, each engine step takes its price x a draw of mean 1:
    the same seed gives the same times, another seed others, and a cv of 0 the price."""
    jittery = H100.model_copy(update={"step_time_cv": 0.1})

    def tpots(profile, seed):
        async def main():
            fleet = Fleet(profile, 1, EngineLimits(), seed=seed)
            return await fleet.run([FleetRequest(0.0, tuple(range(64)), 200)],
                                   make_router("default"))
        [r] = run_virtual(main())
        return r.tpot_s

    assert tpots(jittery, 1) == tpots(jittery, 1) != tpots(jittery, 2)
    assert tpots(jittery, 1) == pytest.approx(H100.decode_s(1), rel=0.05)  # 199 steps' mean
    assert tpots(H100, 1) == pytest.approx(H100.decode_s(1))


def test_adapter_affinity_loads_less_and_answers_sooner_than_serves_default_router():
    """4 replicas, 24 adapters, 8 resident and 2 per batch on each (every adapter fits in
    the fleet, not on one replica): the mesh's router (packing adapters, with LoRA batch
    slots) against power of two choices, the same requests."""
    limits = EngineLimits(max_num_seqs=16, max_loras=2, max_cpu_loras=8,
                          max_ongoing_requests=16)
    reqs = many_adapters(20, 20, adapters=24, seed=1)
    figures = {}
    for router in ("default", "affinity"):
        done, fleet = serve(reqs, replicas=4, router=router, limits=limits)
        late = [r for r in done if r.arrival >= 5]
        figures[router] = (sum(r.loaded_adapter for r in late) / len(late),
                           percentile([r.ttft_s for r in late], 95))
    print(figures)
    assert figures["affinity"][0] < 0.5 * figures["default"][0]
    assert figures["affinity"][1] < 0.5 * figures["default"][1]


def light_behind_heavy(fairness: str, heavy_clients: int = 16) -> list[FleetRequest]:
    """test_fairness.py's scene on the virtual clock (this host's profile at the suite's
    time_scale 0.25, one replica of ``max_num_seqs`` 8): a heavy tenant keeps
    ``heavy_clients`` 64-token requests going, a light tenant sends 40 8-token requests one
    at a time from 3 s on; the light tenant's requests as served."""
    heavy = ClosedLoop(total=10**6, clients=heavy_clients, prompt_tokens=33, max_tokens=64)
    light = ClosedLoop(total=40, clients=1, prompt_tokens=33, max_tokens=8)
    light.prompt = light.prompt[::-1]  # its own prompt: nothing cached from the heavy one
    first_light = light.requests()
    for r in first_light:
        r.arrival, r.tenant = 3.0, "light"
    heavy_first = heavy.requests() if heavy_clients else []
    for r in heavy_first:
        r.tenant = "heavy"
    lights = []

    def follow_up(done: FleetRequest) -> FleetRequest | None:
        source = light if done.tenant == "light" else heavy
        if done.tenant == "light":
            lights.append(done)
        elif len(lights) == light.total:
            return None  # the light tenant is done: so is the run
        nxt = source.follow_up(done)
        if nxt is not None:
            nxt.tenant = done.tenant
        return nxt

    async def main():
        admission = VariantAdmission("sim", fairness=fairness, newcomer_slots=1,
                                     anticipation_s=0.05,  # the router's defaults
                                     clock=asyncio.get_running_loop().time)
        admission.set_capacity(8)
        fleet = Fleet(CPU, 1, EngineLimits(max_num_seqs=8, max_ongoing_requests=10),
                      admission=admission)
        await fleet.run(heavy_first + first_light, make_router("affinity"), follow_up)
    run_virtual(main())
    return lights


def test_token_fair_admission_adds_no_wait_and_the_engine_step_is_what_remains():
    """The light tenant of test_fairness.py, exact: token-fair admission starts each light
    request at once (0 s in the router; FIFO: behind the heavy tenant's queue). What is
    left of its TTFT is the engine's: the rest of the step in progress, then its own step
    of a full batch, with the heavy tenant's new prefills in either; that alone is about
    2x its idle TTFT on this profile at p95, so the issue's goal (p95 <= 2x idle) is not
    met by admission (printed; docs/scale.md)."""
    idle = percentile([r.ttft_s for r in light_behind_heavy("tokens", heavy_clients=0)], 95)
    fair, fifo = light_behind_heavy("tokens"), light_behind_heavy("fifo")
    assert len(fair) == len(fifo) == 40
    assert max(r.routed_at - r.arrival for r in fair) == 0.0
    assert percentile([r.routed_at - r.arrival for r in fifo], 50) > 1.0
    full_step = CPU.step_s(batch=8, prefill_tokens=33, adapters=0, prefill_lengths=[33])
    floor = (full_step + CPU.decode_s(8)) / idle  # the step in progress, then its own
    ratio = percentile([r.ttft_s for r in fair], 95) / idle
    print(f"\nlight TTFT p95 token-fair {ratio:.2f}x idle ({idle * 1000:.0f} ms), p50 "
          f"{percentile([r.ttft_s for r in fair], 50) / idle:.2f}x; a full step in progress "
          f"then its own: {floor:.2f}x; FIFO {percentile([r.ttft_s for r in fifo], 95) / idle:.0f}x")
    assert floor > 1.9  # why the goal cannot be met by any order here (a change to the
    # profile that moves this changes what the test above can show)


@pytest.mark.xfail(strict=True, reason=(
    "issue 26's goal, not reachable by any admission order on this profile: the light "
    "request starts at once (0 s in the router, the test above), and the step in progress "
    "plus its own step of a full batch alone take 2.05x its idle TTFT; measured 2.12x at p95. "
    "Strict: if the mesh ever meets the goal, this fails and the marker must go."))
def test_the_light_tenants_ttft_p95_is_within_2x_its_idle_ttft():
    """Issue 26's goal for test_fairness.py's scene, on the virtual clock where it is exact
    (on the real mesh the host's fixed overhead dilutes the ratio either way)."""
    idle = percentile([r.ttft_s for r in light_behind_heavy("tokens", heavy_clients=0)], 95)
    fair = percentile([r.ttft_s for r in light_behind_heavy("tokens")], 95)
    assert fair <= 2 * idle, (fair, idle)


def light_tenants_on_a_fleet(heavy_rate: float, newcomer_rule: bool = True
                             ) -> list[FleetRequest]:
    """``bench.py --sim h100-llama3-8b --workloads tenants``'s scene, shorter: 8 replicas of
    ``max_num_seqs`` 64, a heavy tenant at ``heavy_rate``/s and 7 light ones at 3.6/s for
    12 s, token-fair admission keeping an eighth of the 512 slots for newcomers (64), the
    mesh's replica router with its newcomer rule (rule 6 of replica_affinity) or without it;
    the light tenants' requests from 4 s on, as served."""
    limits = EngineLimits(max_num_seqs=64, max_ongoing_requests=80)

    class WithoutTheRule(MeshAffinity):
        def choose(self, req, pool):
            req.newcomer = False
            return super().choose(req, pool)

    async def main():
        admission = VariantAdmission("sim", queue_timeout_s=30, fairness="tokens",
                                     newcomer_slots=64, clock=asyncio.get_running_loop().time)
        admission.set_capacity(8 * 64)
        fleet = Fleet(H100, 8, limits, admission=admission)
        route = make_router("affinity") if newcomer_rule else WithoutTheRule
        return await fleet.run(tenants(heavy_rate, 3.6, 12.0), route)
    return [r for r in run_virtual(main()) if r.tenant != "heavy" and r.arrival >= 4]


def test_on_a_fleet_a_newcomers_request_finds_a_seat_free_of_prefills_within_2x_idle():
    """Issue 29's tenants goal (light TTFT p95 <= 2x idle while the heavy tenant is
    backlogged) on the GPU profile: each heavy request admitted brings its prefill into its
    replica's next step; a light request in a newcomer slot goes to a replica with a seat
    free that the router sent nothing to for longest, so the step it joins seldom carries
    another prefill. The same fleet without the rule, for the contrast."""
    heavy = 1.25 * 8 * 64 / (H100.decode_s(64) * 128)  # 1.25x what 8 full batches decode
    idle = percentile([r.ttft_s for r in light_tenants_on_a_fleet(0.0)], 95)
    ruled = light_tenants_on_a_fleet(heavy)
    plain = light_tenants_on_a_fleet(heavy, newcomer_rule=False)
    assert all(r.rejected is None for r in ruled + plain)
    # nearly every light request ran in a newcomer slot, where the rule applies
    assert sum(r.newcomer for r in ruled) > 0.8 * len(ruled)
    with_rule = percentile([r.ttft_s for r in ruled], 95) / idle
    without = percentile([r.ttft_s for r in plain], 95) / idle
    print(f"\nlight TTFT p95 / idle ({idle * 1000:.1f} ms): {with_rule:.2f}x with the "
          f"newcomer rule, {without:.2f}x without")
    assert with_rule <= 2.0
    assert with_rule < without


def burst_with_probe(flood: int) -> tuple[list[FleetRequest], list[FleetRequest]]:
    """test_overload.py's drill on the virtual clock (tenants.yaml's smollm-v1: one replica
    of ``max_num_seqs`` 8, ``queue_timeout_s`` 30, ``reserved_slots`` 1, the router's
    defaults; priorities off): ``flood`` 16-token requests of the batch tenant at once, and
    acme's 4-token probe one after another from the same moment for 40 s (20 requests when
    there is no flood). Admission starts from the replica's start-up measure of a full batch,
    as the router does. Returns (the flood's requests, the probe's), as served or refused."""
    flood_reqs = ClosedLoop(total=flood, clients=flood, prompt_tokens=33, max_tokens=16)
    probe = ClosedLoop(total=10**6 if flood else 20, clients=1, prompt_tokens=20,
                       max_tokens=4)
    probe.prompt = probe.prompt[::-1]
    first = []
    for tenant, load in (("batch", flood_reqs), ("acme", probe)):
        for r in load.requests():
            r.tenant = tenant
            first.append(r)

    def follow_up(done: FleetRequest) -> FleetRequest | None:
        if done.tenant == "batch" or done.done_at > 40:
            return None
        nxt = probe.follow_up(done)
        if nxt is not None:
            nxt.tenant = "acme"
        return nxt

    async def main():
        # LLMReplica's start-up measure: a full batch of CALIBRATION_TOKENS-token requests
        batch = ClosedLoop(total=8, clients=8, prompt_tokens=8, max_tokens=CALIBRATION_TOKENS)
        measured = await Fleet(CPU, 1, LIMITS).run(batch.requests(), make_router("default"))
        admission = VariantAdmission("sim", queue_timeout_s=30, reserved_slots=1,
                                     newcomer_slots=1, anticipation_s=0.05,
                                     clock=asyncio.get_running_loop().time)
        admission.set_capacity(8, max(r.done_at for r in measured))
        return await Fleet(CPU, 1, LIMITS, admission=admission).run(
            first, make_router("default"), follow_up)
    done = run_virtual(main())
    return [r for r in done if r.tenant == "batch"], [r for r in done if r.tenant == "acme"]


def test_a_burst_of_400_gets_what_the_engine_can_do_and_the_probe_keeps_its_ttft():
    """Issue 28's overload goals, exact (test_overload.py runs the drill on the real mesh,
    where the flood's own client shares the 2 cores with the router): the answers are at
    least 80 % of what the engine sustained x queue_timeout_s (the time of the last answer
    / 30 s, as ``bench.drills`` reckons it); every refusal comes before the
    deadline; the probe is served throughout, its TTFT p50 within 3x idle."""
    _, idle = burst_with_probe(0)
    flood, probes = burst_with_probe(400)
    answered = [r for r in flood if r.rejected is None]
    refused = [r for r in flood if r.rejected is not None]
    goodput = max(r.done_at for r in answered) / 30
    idle_p50 = percentile([r.ttft_s for r in idle], 50)
    during = [r.ttft_s for r in probes if r.arrival > 0]
    refused_after = percentile([r.refused_at - r.arrival for r in refused], 95)
    print(f"\n[simulated: cpu-smollm2 x0.25, virtual clock] flood of 400: {len(answered)} "
          f"answered, refused {len(refused)} ({dict(Counter(r.rejected for r in refused))}) "
          f"p95 {refused_after:.1f} s after arrival; goodput {goodput:.2f}; probe TTFT p50 "
          f"idle {idle_p50 * 1000:.0f} ms, during the flood "
          f"{percentile(during, 50) * 1000:.0f} ms over {len(during)} requests")
    assert refused and goodput >= 0.8
    assert all(r.generated == 16 for r in answered)
    assert all(r.done_at is None for r in refused)  # refused before running
    assert refused_after < 30
    assert all(r.rejected is None for r in probes) and len(during) >= 3
    assert percentile(during, 50) <= 3 * idle_p50


def test_bench_sim_smoke_at_small_size_writes_its_figures_and_plots(tmp_path):
    """The CI smoke run of ``bench.py --sim`` (2 replicas, 8 adapters; the full-size run is
    out of CI: docs/scale.md)."""
    out = subprocess.run(
        [sys.executable, "scripts/bench.py", "--sim", "h100-llama3-8b", "--small",
         "--rates", "5", "20", "--duration-s", "8", "--warmup-s", "2",
         "--plots", str(tmp_path), "--json", str(tmp_path / "sim.json"),
         "--router-cost", "8", "--trust"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SIMULATED, profile h100-llama3-8b" in out.stdout
    figures = json.loads((tmp_path / "sim.json").read_text())
    assert set(figures["many-adapters"]["goodput"]) == {
        "default", "multiplex", "affinity", "affinity-no-adapter"}
    assert figures["sessions"]["hit_share"] > 0
    assert figures["tenants"]["fair_over_idle"] > 0
    assert figures["router_cost"][0]["replicas"] == 8
    assert {row["run"] for row in figures["trust"]} >= {"K=16 adapters, affinity",
                                                         "sessions 00:31, default"}
    assert all(row["tokens_per_s"]["sim"] > 0 for row in figures["trust"])
    trust = {row["run"]: row for row in figures["trust"]}
    reference, mesh = trust["base-only, vLLM's own server"], trust["base-only, mesh, 1 replica"]
    assert reference["time_scale"] == 1.0
    # the same load on one engine whose workers got less of a core than the reference's:
    # replayed x (the reference's share / its own), every duration, so its tokens/s is the
    # reference's / that scale
    assert mesh["time_scale"] == round(reference["worker_cores"] / mesh["worker_cores"], 3) > 1
    assert (mesh["tokens_per_s"]["sim"] * mesh["time_scale"]
            == pytest.approx(reference["tokens_per_s"]["sim"], rel=0.03))
    # the goal: within 25 % of the real runs, but for the simulated draws of Serve's
    # default router on the sessions (their range, docs/scale.md); with a real run's
    # placement replayed, its hit rate is the real one, and its TTFT is compared from each
    # request's routing on (the replay's wait for the placed replica, which the real run's
    # timing did not have, left out: docs/scale.md gives both)
    replayed = [row for row in figures["trust"] if row["placement_replayed"]]
    assert len(replayed) == 3
    for row in figures["trust"]:
        if row["run"].startswith("sessions") and row["router"] == "default" and (
                not row["placement_replayed"]):
            continue
        ttft = row["ttft_p50_routed_s" if row["placement_replayed"] else "ttft_p50_s"]
        assert abs(row["tokens_per_s"]["error"]) <= 0.25, row
        assert abs(ttft["error"]) <= 0.25, row
        assert ttft["sim"] <= row["ttft_p50_s"]["sim"]
    for row in replayed:
        assert row["same_replica"]["sim"] == row["same_replica"]["real"]
        assert row["hit_rate"]["sim"] == pytest.approx(row["hit_rate"]["real"], abs=0.03)
    for name in ("many-adapters", "sessions", "tenants"):
        assert (tmp_path / f"sim-h100-llama3-8b-{name}.png").stat().st_size > 10_000
