"""The affinity router reads any body without raising, never fails a request's routing, and
remembers a session by a fixed-size key (no Ray: Serve's router API with its own state
set by hand, as Serve's ``__init__`` needs a cluster).

A body the router could not read used to raise in ``choose_replicas``; through Serve that
became 503 ``no_healthy_variant`` and a failover counted against the variant, for a
client's own malformed body. Sessions were keyed by the raw ``x-session-id`` / ``user``:
300 ``user`` values of 1 MiB each held 302 MiB of router memory."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from serve_app.common.config import RouterConfig
from serve_app.common.wire import GenerateRequest
from serve_app.replica_routing import router as replica_router
from serve_app.request.planner import RequestPlanner
from serve_app.replica_routing.router import AffinityRouter, affinity_inputs
from serve_app.request.split import splits_of

HOSTILE_CHATS = [
    [{"role": "user", "content": [{"type": "text", "text": 123}]}],  # the reported body
    [{"role": "user", "content": [{"type": "text", "text": None}, {"text": ["a"]}, 5, None,
                                  [1, 2], "plain", {"type": "image_url"}]}],
    [{"role": 7, "content": {"text": "x"}}, {"role": None}, {}, 1, None, "s", [[]]],
    [{"role": "user", "content": "\ud800 lone surrogate " * 20}],
    [{"role": {"a": [1]}, "content": [{"text": "\udfff" * 300}]}],
    "not a list", None, 3, {"role": "user"},
]
HOSTILE_PROMPTS = [[1, 2, 3], [[1, 2]], [None], [], {"a": 1}, 5, None, "\ud800" * 300,
                   [{"text": "x"}], [["a", 1]]]
HOSTILE_MODELS = ["smollm:\ud800", 123, None, ["smollm"], {"a": 1}, ":", "smollm:" + "a" * 9999]


def router() -> AffinityRouter:
    router = AffinityRouter.__new__(AffinityRouter)  # Serve's own __init__ needs a cluster
    router._deployment_id = None
    router.initialize_state(block_chars=16)
    replicas = [SimpleNamespace(replica_id=rid, routing_stats={"at": 1.0}) for rid in "abc"]
    router._replicas = {r.replica_id: r for r in replicas}
    router._replica_queue_len_cache = SimpleNamespace(get={"a": 1, "b": 0, "c": 2}.get)
    return router


def pending(request: GenerateRequest, rid: str = "r1"):
    return SimpleNamespace(args=[request], metadata=SimpleNamespace(
        call_method="generate", internal_request_id=rid))


def ranks(r: AffinityRouter, request: GenerateRequest, rid: str = "r1") -> list[list[str]]:
    replicas = list(r._replicas.values())
    chosen = asyncio.run(r.choose_replicas(replicas, pending(request, rid)))
    return [[x.replica_id for x in rank] for rank in chosen]


def bodies():
    for messages in HOSTILE_CHATS:
        yield "chat", {"model": "smollm", "messages": messages}
    for prompt in HOSTILE_PROMPTS:
        yield "completion", {"model": "smollm", "prompt": prompt}
    for model in HOSTILE_MODELS:
        yield "chat", {"model": model, "messages": [{"role": "user", "content": "hi" * 40}]}


@pytest.mark.parametrize("endpoint, body", list(bodies()))
def test_any_json_shape_is_read_without_raising_and_routed_by_the_rules(endpoint, body):
    request = GenerateRequest(endpoint, body, session="s1")
    affinity_inputs(request, 16)
    r = router()
    chosen = ranks(r, request)
    assert sorted(x for rank in chosen for x in rank) == ["a", "b", "c"]
    assert r._chosen["r1"][1] in ("new", "hit", "session", "adapter")  # the rules ran
    r.on_request_routed(pending(request), "b", None)
    assert r.affinity._sessions["s1"] == "b"


def test_the_reported_body_gets_the_same_prefix_keys_as_its_text_only():
    """The int ``text`` part adds nothing; the string parts around it are read."""
    keyed = GenerateRequest("chat", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x" * 40}, {"type": "text", "text": 123}]}]})
    plain = GenerateRequest("chat", {"model": "m", "messages": [
        {"role": "user", "content": "x" * 40}]})
    assert affinity_inputs(keyed, 16) == affinity_inputs(plain, 16)


def test_choose_replicas_never_raises_it_falls_back_to_serve_s_choice(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("a rule's bug")

    monkeypatch.setattr(replica_router, "rank_replicas", broken)
    monkeypatch.setattr(replica_router, "affinity_inputs", broken)
    r = router()
    request = GenerateRequest("chat", {"model": "m", "messages": []})
    assert ranks(r, request) == [["a", "b", "c"]]  # one rank of all: Serve picks by load
    assert ranks(r, request, "r2") == [["a", "b", "c"]]
    r.on_request_routed(pending(request), "a", None)  # Serve's hook does not raise either
    assert [m for m in caplog.messages if "Serve's default choice" in m][:1], caplog.messages


def test_sessions_are_kept_by_a_fixed_size_key_whatever_the_id_s_size():
    """50 ``user`` values of 1 MiB each, through the planner and the replica router's
    table: the table keeps 50 keys of 32 characters (before: 50 MiB of keys)."""
    config = RouterConfig.model_validate({"routes": {"smollm": {"variants": [
        {"application": "v1", "weight": 1}]}}})
    availability = SimpleNamespace(prefer_available=list, may_be_asleep=lambda a: False,
                                   is_asleep=lambda a: False)
    planner = RequestPlanner(config, splits_of(config), lambda key, split: split.weighted,
                             availability)
    r = router()
    for i in range(50):
        user = f"user-{i:03d}-" + "x" * (1024 * 1024)
        plan = asyncio.run(planner.plan("chat", {"model": "smollm", "user": user,
                                                 "messages": []}, None))
        r.on_request_routed(pending(plan.request, f"r{i}"), "abc"[i % 3], None)
    keys = list(r.affinity._sessions)
    assert len(keys) == 50 and {len(k) for k in keys} == {32}
    # The same id through the header, of two tenants: two conversations, not one.
    from serve_app.request.planner import conversation
    t1, t2 = SimpleNamespace(id="acme"), SimpleNamespace(id="globex")
    assert conversation("s", {}, t1) != conversation("s", {}, t2)
    assert conversation("s", {}, t1) == conversation(None, {"user": "s"}, t1)
