"""The replica router's decision (serve_app/replica_routing/affinity.py): prefix and session
affinity under a load bound, pure logic. The real router on real replicas:
tests/integration/test_replica_routing.py."""

from __future__ import annotations

from collections import Counter

import pytest

from serve_app.common.wire import GenerateRequest
from serve_app.replica_routing.affinity import ReplicaAffinity, prefix_keys, prompt_text
from serve_app.replica_routing.router import affinity_inputs

SYSTEM = "You are the support assistant of ACME. " * 20  # ~800 characters


def chat(*contents: str) -> dict:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"model": "smollm", "messages": [{"role": r, "content": c}
                                            for r, c in zip(roles, contents)]}


def keys(*contents: str, adapter=None) -> list[bytes]:
    return prefix_keys(prompt_text("chat", chat(*contents)), adapter, block_chars=64)


def route(table: ReplicaAffinity, k, session, loads) -> tuple[str, str]:
    """What Serve does with the ranks: the least-loaded replica of the first rank."""
    choice = table.choose(k, session, loads)
    replica = min(choice.ranks[0], key=lambda r: loads[r])
    table.record(k, session, replica)
    return replica, choice.decision


def test_keys_chain_whole_blocks_and_carry_the_adapter():
    text = "x" * 130
    assert len(prefix_keys(text, block_chars=64)) == 2  # the 2 trailing characters: no key
    assert prefix_keys("a" * 64 + "b" * 64, block_chars=64)[0] == prefix_keys(
        "a" * 64 + "c" * 64, block_chars=64)[0]  # a shared first block, then they part
    assert prefix_keys("a" * 64 + "b" * 64, block_chars=64)[1] != prefix_keys(
        "a" * 64 + "c" * 64, block_chars=64)[1]
    assert prefix_keys(text, "acme-support@v1", 64) != prefix_keys(text, None, 64)
    assert prefix_keys("short", block_chars=64) == []


def test_prompt_text_reads_chat_parts_and_completion_prompts():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text("chat", body) == "user: hi\n"
    assert prompt_text("completion", {"prompt": ["once upon", "x"]}) == "once upon"
    assert prompt_text("chat", {"messages": "not a list"}) == ""
    assert prompt_text("completion", {"prompt": 5}) == ""


def test_a_conversation_stays_on_the_replica_that_holds_its_history():
    table = ReplicaAffinity(imbalance_bound=4)
    loads = {"a": 0, "b": 0}
    first, decision = route(table, keys(SYSTEM, "Where is my order?"), None, loads)
    assert decision == "new"
    later = keys(SYSTEM, "Where is my order?", "It shipped.", "When does it arrive?")
    assert route(table, later, None, {"a": 1, "b": 1}) == (first, "hit")
    # A session goes back to its replica even when its prompt shares nothing held.
    table.record([], "acme/s1", first)
    assert route(table, keys("unrelated " * 30), "acme/s1", loads) == (first, "session")


def test_two_new_prefixes_go_to_different_replicas():
    table = ReplicaAffinity()
    a, _ = route(table, keys("Tenant one's long system prompt. " * 10, "q"), None,
                 {"a": 0, "b": 0})
    b, decision = route(table, keys("Tenant two's other system prompt! " * 10, "q"), None,
                        {"a": 0, "b": 0})
    assert decision == "new" and {a, b} == {"a", "b"}  # the emptier cache takes the new one


def test_a_busy_holder_spills_and_a_hot_prefix_spreads_over_every_replica():
    table = ReplicaAffinity(imbalance_bound=2)
    hot = keys(SYSTEM, "question")
    holder, _ = route(table, hot, None, {"a": 0, "b": 0, "c": 0})
    busy = {"a": 0, "b": 0, "c": 0, holder: 3}
    spilled, decision = route(table, hot, None, busy)
    assert decision == "spill" and spilled != holder
    # Simulated steady load: each request stays in flight for 4 routings.
    table, in_flight, served = ReplicaAffinity(imbalance_bound=2), [], Counter()
    for _ in range(300):
        loads = {r: in_flight.count(r) for r in "abc"}
        replica, _ = route(table, hot, None, loads)
        served[replica] += 1
        in_flight = (in_flight + [replica])[-4 * 3:]
    assert max(served.values()) <= 2 * min(served[r] for r in "abc"), served


def test_within_the_bound_affinity_holds():
    table = ReplicaAffinity(imbalance_bound=4)
    k = keys(SYSTEM, "q")
    holder, _ = route(table, k, None, {"a": 0, "b": 0})
    other = "b" if holder == "a" else "a"
    assert route(table, k, None, {holder: 4, other: 0}) == (holder, "hit")
    assert route(table, k, None, {holder: 5, other: 0})[1] == "spill"


def test_a_replica_that_leaves_loses_only_its_own_prefixes_and_sessions():
    table = ReplicaAffinity()
    placed = {}
    for i in range(6):
        k = keys(f"tenant {i} system prompt " * 12, "q")
        placed[i] = (k, route(table, k, f"t/{i}", {"a": 0, "b": 0, "c": 0})[0])
    gone = placed[0][1]
    table.forget(gone)
    for i, (k, replica) in placed.items():
        loads = {r: 0 for r in "abc" if r != gone}
        if replica != gone:
            assert route(table, k, None, loads) == (replica, "hit")
    assert table.held[gone] == 0
    # A new replica takes new prefixes only: every held one stays where it is.
    for i, (k, replica) in placed.items():
        if replica != gone:
            assert table.choose(k, None, {"a": 0, "b": 0, "c": 0, "d": 0}).ranks[0] == [replica]


def test_the_table_is_bounded():
    table = ReplicaAffinity(max_blocks=10, max_sessions=2)
    for i in range(5):
        table.record(keys(f"prompt {i} " * 40), f"s{i}", "a")
    assert sum(table.held.values()) == 10
    assert table.choose([], "s0", {"a": 0, "b": 0}).decision == "new"  # evicted
    assert table.choose([], "s4", {"a": 0, "b": 0}).decision == "session"


def test_bad_bounds_and_no_replicas_are_refused():
    with pytest.raises(ValueError, match="imbalance_bound and adapter_imbalance_bound must"):
        ReplicaAffinity(imbalance_bound=-1)
    with pytest.raises(ValueError, match="no replica"):
        ReplicaAffinity().choose([], None, {})


def test_router_inputs_key_an_adapter_version_apart_from_its_base():
    body = chat(SYSTEM, "q")
    base = GenerateRequest("chat", body, session="acme/s1")
    lora = GenerateRequest("chat", {**body, "model": "smollm:acme-support"},
                           adapter_version="acme-support@v2")
    assert affinity_inputs(base, 64)[1] == "acme/s1"
    assert affinity_inputs(base, 64)[0] != affinity_inputs(lora, 64)[0]
    assert affinity_inputs(base, 64)[0] == keys(SYSTEM, "q")


def test_validate_names_a_bad_router_keyword_and_accepts_the_shipped_config():
    from serve_app.common.paths import REPO_ROOT
    from serve_app.common.serve_configs import load_yaml
    from serve_app.release.validate import validate_config

    cfg = load_yaml(REPO_ROOT / "serve_configs" / "affinity.yaml")
    assert validate_config(cfg) == []
    kwargs = cfg["applications"][1]["deployments"][0]["request_router_config"][
        "request_router_kwargs"]
    kwargs["imbalance"] = 3
    assert validate_config(cfg) == [
        "applications[1].deployments[LLMReplica].request_router_config.request_router_kwargs: "
        "unknown AffinityRouter keyword imbalance (known: imbalance_bound, block_chars, "
        "max_blocks, max_sessions, adapter_imbalance_bound, min_match_rate)"]
    del kwargs["imbalance"]
    kwargs["block_chars"] = 0
    assert "block_chars must be >= 1, not 0" in validate_config(cfg)[0]


@pytest.mark.parametrize("ingress", ["haproxy", "proxy"])
def test_the_affinity_router_validates_under_either_ingress(monkeypatch, ingress):
    """Ray refuses a custom request router on an application's ingress deployment under
    HAProxy; a variant's LLMReplica is not its ingress (serve_app.variant_ingress), so
    affinity.yaml is valid behind either ingress."""
    from serve_app.common.paths import REPO_ROOT
    from serve_app.common.serve_configs import load_yaml
    from serve_app.common.serve_env import INGRESS_VAR
    from serve_app.release.validate import validate_config

    monkeypatch.setenv(INGRESS_VAR, ingress)
    assert validate_config(load_yaml(REPO_ROOT / "serve_configs" / "affinity.yaml")) == []


def test_new_conversations_without_a_whole_block_are_spread_too():
    table = ReplicaAffinity()
    table.record(keys(SYSTEM), None, "a")  # "a" holds a system prompt's blocks already
    sessions = len(keys(SYSTEM)) + 4
    first = [route(table, [], f"t/s{i}", {"a": 0, "b": 0})[0] for i in range(sessions)]
    assert first[0] == "b" and set(first) == {"a", "b"}
    assert abs(table.held["a"] + table.conversations["a"] - table.conversations["b"]) <= 1


def test_router_inputs_carry_the_adapter_the_split_chose_else_its_name():
    body = {**chat(SYSTEM, "q"), "model": "smollm:acme-support"}
    assert affinity_inputs(GenerateRequest("chat", body), 64)[2] == "acme-support"
    assert affinity_inputs(GenerateRequest("chat", body, adapter_version="acme-support@v2"),
                           64)[2] == "acme-support@v2"
    assert affinity_inputs(GenerateRequest("chat", chat(SYSTEM, "q")), 64)[2] is None


def adapter_route(table, adapter, loads, reported, at=100.0):
    """A request with no prefix or session, for ``adapter``; Serve takes the first rank."""
    choice = table.choose([], None, loads, adapter, table.adapter_holders(adapter, reported))
    replica = min(choice.ranks[0], key=lambda r: loads[r])
    table.record([], None, replica, adapter, at=at)
    return replica, choice.decision


def test_an_adapter_request_goes_to_a_replica_that_reports_it_resident():
    table = ReplicaAffinity(imbalance_bound=2)
    reported = {"a": (["acme-support@v1"], 50.0), "b": (["globex-report@v1"], 50.0)}
    loads = {"a": 1, "b": 0}
    assert adapter_route(table, "acme-support", loads, reported) == ("a", "adapter")
    assert adapter_route(table, "globex-report@v1", loads, reported) == ("b", "adapter")
    # the versioned name matches only that version
    assert table.adapter_holders("acme-support@v2", reported) == []


def test_a_cold_adapter_is_packed_on_one_replica_then_kept_there_until_a_report_drops_it():
    table = ReplicaAffinity(imbalance_bound=2)
    loads = {"a": 0, "b": 0, "c": 0}
    none_yet = {r: ([], 10.0) for r in loads}
    first, decision = adapter_route(table, "tenant-7", loads, none_yet, at=20.0)
    assert decision == "new"
    # every router agrees (rendezvous on the name), and this one remembers where it sent it
    assert ReplicaAffinity().choose([], None, loads, "tenant-7").ranks[0] == [first]
    assert adapter_route(table, "tenant-7", loads, none_yet, at=21.0) == (first, "adapter")
    # a report newer than the last routing that does not list it: it was evicted there
    evicted = {**none_yet, first: ([], 30.0)}
    assert table.adapter_holders("tenant-7", evicted) == []


def test_a_hot_adapter_spreads_past_the_adapter_imbalance_bound():
    table = ReplicaAffinity(imbalance_bound=8, adapter_imbalance_bound=2)
    reported = {"a": (["hot@v1"], 50.0), "b": ([], 50.0)}
    assert adapter_route(table, "hot", {"a": 2, "b": 0}, reported) == ("a", "adapter")
    assert adapter_route(table, "hot", {"a": 3, "b": 0}, reported) == ("b", "spill")
    # now both hold it (b by this router's own record): the less busy one of them serves
    assert sorted(table.adapter_holders("hot", reported)) == ["a", "b"]
    assert adapter_route(table, "hot", {"a": 3, "b": 1}, reported) == ("b", "adapter")


def test_a_prefix_hit_wins_over_adapter_residency_and_forget_drops_the_replicas_routes():
    table = ReplicaAffinity(imbalance_bound=4)
    k = keys(SYSTEM, "q", adapter="acme-support")
    table.record(k, None, "b", "acme-support", at=60.0)
    reported = {"a": (["acme-support@v1"], 50.0), "b": ([], 50.0)}
    assert table.choose(k, None, {"a": 0, "b": 0}, "acme-support",
                        table.adapter_holders("acme-support", reported)).ranks[0] == ["b"]
    table.forget("b")
    assert table.adapter_holders("acme-support", reported) == ["a"]


def test_conversations_that_share_only_a_system_prompt_spread_over_the_replicas():
    """A run of held blocks below min_match_rate of the prompt is no hit: each tenant's new
    conversations (system prompt + a long document of their own) go where the cache is
    emptiest, not all to the replica that cached the system prompt first."""
    table = ReplicaAffinity(imbalance_bound=4)
    served = Counter()
    for s in range(8):
        document = f"document {s} " * 150  # ~1,800 characters, the system prompt's double
        replica, decision = route(table, keys(SYSTEM, document), f"s{s}", {"a": 0, "b": 0})
        assert decision == "new"
        served[replica] += 1
    assert served == {"a": 4, "b": 4}
    # A short question after the same system prompt is mostly cached prompt: a hit.
    assert route(table, keys(SYSTEM, "Where is my order?"), None, {"a": 0, "b": 0})[1] == "hit"
    # With min_match_rate 0 any held block counts, as before.
    greedy = ReplicaAffinity(min_match_rate=0)
    first, _ = route(greedy, keys(SYSTEM, "document 0 " * 150), None, {"a": 0, "b": 0})
    assert route(greedy, keys(SYSTEM, "document 1 " * 150), None, {"a": 0, "b": 0}) == (
        first, "hit")


def test_a_holder_whose_batches_hold_max_loras_other_adapters_is_passed_over_for_one_with_a_slot():
    """vLLM batches at most max_loras adapters: a request for another waits in the engine
    until one of them drains. The router counts the adapters of its requests in flight."""
    table = ReplicaAffinity(adapter_imbalance_bound=8)
    reported = {"a": (["x@v1", "y@v1", "z@v1"], 50.0), "b": ([], 50.0), "c": ([], 50.0)}
    loads = {"a": 2, "b": 0, "c": 0}
    for adapter in ("y@v1", "z@v1"):  # a's batches now mix 2 adapters
        table.record([], None, "a", adapter, at=60.0)
    max_loras = {"a": 2, "b": 2, "c": 2}
    choice = table.choose([], None, loads, "x@v1", table.adapter_holders("x@v1", reported),
                          max_loras)
    assert choice.decision == "spill" and choice.ranks[0] in (["b"], ["c"])
    # the adapter a request of it already runs on fits there, whatever else runs
    table.record([], None, "a", "x@v1", at=61.0)
    assert table.choose([], None, loads, "x@v1", ["a"], max_loras).ranks[0] == ["a"]
    # once a y request completes, a has a slot again for an adapter it holds
    table.completed("a", "y@v1")
    table.completed("a", "x@v1")
    assert table.choose([], None, loads, "x@v1", ["a"], max_loras).decision == "adapter"
    # no max_loras reported: the slot rule does not apply
    table.record([], None, "a", "y@v1", at=62.0)
    assert table.choose([], None, loads, "x@v1", ["a"]).ranks[0] == ["a"]


def test_a_cold_adapter_is_packed_among_the_replicas_with_a_lora_slot():
    table = ReplicaAffinity()
    loads = {"a": 0, "b": 0, "c": 0}
    first = table.choose([], None, loads, "new@v1", (), {"a": 1, "b": 1, "c": 1}).ranks[0][0]
    table.record([], None, first, "other@v1")  # its only batch slot is taken
    second = table.choose([], None, loads, "new@v1", (), {"a": 1, "b": 1, "c": 1})
    assert second.decision == "new" and second.ranks[0][0] != first
    table.forget(first)
    assert first not in table.running


def test_a_cold_adapter_goes_to_the_least_loaded_replica_with_a_lora_slot():
    """Not anywhere within the adapter bound (64 here): its requests then run in the short
    steps of a lightly loaded replica and free their LoRA batch slot soonest (the
    many-adapters simulation: TTFT p95 at 258.9 requests/s from 1.46 s to 0.83 s). A spill
    (every holder's batches full of other adapters) is placed the same way."""
    table = ReplicaAffinity()
    seqs, slots = {"a": 64, "b": 64, "c": 64}, {"a": 1, "b": 1, "c": 1}
    loads = {"a": 5, "b": 2, "c": 30}
    for name in (f"cold-{i}@v1" for i in range(20)):
        assert table.choose([], None, loads, name, (), slots, seqs).ranks[0] == ["b"]
    table.record([], None, "b", "other@v1")  # b's only LoRA batch slot is taken
    assert table.choose([], None, loads, "cold-0@v1", (), slots, seqs).ranks[0] == ["a"]
    even = {"a": 2, "b": 2, "c": 5}  # ties: by name, so routers that see the same loads agree
    picks = {name: table.choose([], None, even, name, (), None, seqs).ranks[0][0]
             for name in (f"cold-{i}@v1" for i in range(20))}
    assert set(picks.values()) == {"a", "b"}
    assert all(ReplicaAffinity().choose([], None, even, name, (), None, seqs).ranks[0][0]
               == replica for name, replica in picks.items())
    table.record([], None, "a", "x@v1")  # hot's holder a: its slot runs another adapter
    four = {"a": 40, "b": 2, "c": 3, "d": 9}
    spill = table.choose([], None, four, "hot@v1", ["a"], {**slots, "d": 1},
                         {**seqs, "d": 64})
    assert (spill.decision, spill.ranks[0]) == ("spill", ["c"])  # b's slot is taken too


def test_a_burst_for_a_cold_adapter_follows_the_first_request_before_it_is_routed():
    """Serve routes a request only once the replica accepts it, and meanwhile counts it in
    that replica's queue: the burst's next requests see another replica less loaded. The
    router marks the adapter held where it chose to load it (``placed``), so they follow."""
    table = ReplicaAffinity()
    loads, none_yet = {"a": 0, "b": 0}, {"a": ([], 10.0), "b": ([], 10.0)}
    first = table.choose([], None, loads, "cold@v1", table.adapter_holders("cold@v1", none_yet))
    assert first.decision == "new"
    table.placed("cold@v1", first.ranks[0][0], at=20.0)
    loads[first.ranks[0][0]] += 1  # Serve's cached queue length after its send
    holders = table.adapter_holders("cold@v1", none_yet)
    assert holders == first.ranks[0]
    assert table.choose([], None, loads, "cold@v1", holders).ranks[0] == first.ranks[0]
    # a report newer than the mark that leaves the adapter out: it went elsewhere after all
    assert table.adapter_holders("cold@v1", {**none_yet, first.ranks[0][0]: ([], 30.0)}) == []


def test_the_router_reads_adapters_max_loras_and_max_num_seqs_from_the_routing_stats():
    from types import SimpleNamespace
    from serve_app.replica_routing.router import reported_stats
    replicas = [SimpleNamespace(replica_id="a", routing_stats={
                    "max_loras": 4, "adapters": ["x@v1"], "max_num_seqs": 64, "at": 5.0}),
                SimpleNamespace(replica_id="b", routing_stats={"max_loras": 0}),
                SimpleNamespace(replica_id="c", routing_stats=None)]
    adapters, max_loras, max_num_seqs = reported_stats(replicas)
    assert adapters == {"a": (["x@v1"], 5.0), "b": ([], 0.0), "c": ([], 0.0)}
    assert max_loras == {"a": 4}
    assert max_num_seqs == {"a": 64}


def test_unless_configured_a_hot_adapter_fills_its_holders_batch_before_it_spreads():
    """The adapter bound defaults to the holder's max_num_seqs (Punica's consolidation): a
    holder 40 requests above the least loaded still takes its adapter's request when it
    runs 64 at once, and spills past 64; a replica that reported nothing gets 8."""
    table = ReplicaAffinity()
    reported = {"a": (["hot@v1"], 1.0), "b": ([], 1.0)}
    holders = table.adapter_holders("hot@v1", reported)
    seqs = {"a": 64, "b": 64}
    packed = table.choose([], None, {"a": 40, "b": 0}, "hot@v1", holders, None, seqs)
    assert (packed.decision, packed.ranks[0]) == ("adapter", ["a"])
    spilled = table.choose([], None, {"a": 65, "b": 0}, "hot@v1", holders, None, seqs)
    assert (spilled.decision, spilled.ranks[0]) == ("spill", ["b"])
    unreported = table.choose([], None, {"a": 9, "b": 0}, "hot@v1", holders)
    assert unreported.decision == "spill" and table.adapter_bound("a", None) == 8
    assert ReplicaAffinity(adapter_imbalance_bound=2).adapter_bound("a", seqs) == 2


def test_a_newcomer_slots_request_goes_to_a_free_seat_routed_to_least_recently():
    """Rule 6: a base-model request admission started in a newcomer slot goes where an
    engine seat is free (in flight below max_num_seqs, the load known), the replica this
    router sent a request to least recently (its last prefill likeliest done; never: first),
    not the least loaded; a session or prefix it has goes first, an adapter request follows
    the adapter rules, and without a seat free it is placed as any new request."""
    table = ReplicaAffinity()
    seqs = {"a": 64, "b": 64, "c": 64, "d": 64}
    for replica, at in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        table.record([], None, replica, at=at)
    loads = {"a": 60, "b": 62, "c": 64, "d": 63}  # c is full; d never took one, but is unknown
    choice = table.choose([], None, loads, newcomer=True, max_num_seqs=seqs, unknown={"d"})
    assert (choice.decision, choice.ranks[0]) == ("newcomer", ["b"])  # b: no request since 1.0
    assert sorted(choice.ranks[1]) == ["a", "c", "d"]
    assert table.choose([], None, loads, newcomer=True, max_num_seqs=seqs).ranks[0] == ["d"]
    table.record([], None, "b", at=4.0)  # b just took one: a's last is older now
    assert table.choose([], None, loads, newcomer=True, max_num_seqs=seqs,
                        unknown={"d"}).ranks[0] == ["a"]
    # without the flag: the least-loaded replica, as before
    assert table.choose([], None, loads, max_num_seqs=seqs).ranks[0] == ["a"]
    assert table.choose([], None, {**loads, "a": 63}, max_num_seqs=seqs).ranks[0] == ["b"]
    # no seat free anywhere, or no seats reported: placed as a new request (rule 5)
    full = {"a": 64, "b": 64, "c": 65, "d": 64}
    assert table.choose([], None, full, newcomer=True, max_num_seqs=seqs).decision == "new"
    assert table.choose([], None, loads, newcomer=True).decision == "new"
    # a session or a prefix held on a replica keeps it; an adapter follows its rules
    table.record([], "s1", "c", at=5.0)
    held = table.choose([], "s1", {**loads, "c": 60}, newcomer=True, max_num_seqs=seqs)
    assert (held.decision, held.ranks[0]) == ("session", ["c"])
    k = keys(SYSTEM, "What is my balance?")
    table.record(k, None, "c", at=6.0)
    hit = table.choose(k, None, {**loads, "c": 60}, newcomer=True, max_num_seqs=seqs)
    assert (hit.decision, hit.ranks[0]) == ("hit", ["c"])
    lora = table.choose([], None, loads, "cold@v1", [], None, seqs, newcomer=True)
    assert lora.decision == "new" and lora.ranks[0] == ["a"]  # the least loaded with a slot
    table.forget("b")
    assert "b" not in table.routed_at


def test_the_serve_router_passes_a_newcomer_slots_mark_to_the_rule():
    """AffinityRouter (Serve's request-router API) reads the request's ``newcomer`` mark
    (set by the dispatcher: tests/unit/dispatch/test_dispatcher.py), the replicas' reported
    ``max_num_seqs`` and Serve's cached queue lengths (unknown: no seat), ranks by rule 6, and
    counts a replica as sent to when it chooses it (the next newcomer of a burst goes elsewhere)
    and again when Serve routes there; without the mark, by rule 5."""
    import asyncio
    from types import SimpleNamespace
    from serve_app.replica_routing.router import AffinityRouter

    router = AffinityRouter.__new__(AffinityRouter)  # Serve's own __init__ needs a cluster
    router._deployment_id = None
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=rid, routing_stats={"max_num_seqs": 8, "at": 1.0})
                for rid in ("a", "b", "c")]
    router._replicas = {r.replica_id: r for r in replicas}
    loads = {"a": 2, "b": 7, "c": None}  # c: Serve's cache does not know it
    router._replica_queue_len_cache = SimpleNamespace(get=loads.get)
    router.affinity.record([], None, "a", at=2.0)  # a took a request last
    router.affinity.record([], None, "b", at=1.0)

    def pending(newcomer: bool, rid: str):
        request = GenerateRequest("completion", {"model": "m", "prompt": "hi"},
                                  newcomer=newcomer)
        return SimpleNamespace(args=[request], metadata=SimpleNamespace(
            call_method="generate", internal_request_id=rid))

    def ranks(newcomer: bool, rid: str) -> list[list[str]]:
        chosen = asyncio.run(router.choose_replicas(replicas, pending(newcomer, rid)))
        return [[r.replica_id for r in rank] for rank in chosen]

    assert ranks(True, "r1")[0] == ["b"]  # a seat free there, and no request since 1.0
    assert router._chosen["r1"][1] == "newcomer"
    assert ranks(True, "r2")[0] == ["a"]  # a burst's next newcomer, before r1 is routed
    assert ranks(False, "r3")[0] == ["c"]  # without the mark: the least loaded (unknown: 0)
    router.on_request_routed(pending(True, "r2"), "a", None)
    assert router.affinity.routed_at["a"] > router.affinity.routed_at["b"]
    assert ranks(True, "r4")[0] == ["b"]
