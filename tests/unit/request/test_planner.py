"""Unit tests of the request planner (no Ray, no HTTP): model names, tenancy, adapter versions,
pinning, sticky candidates and failover order, priority, metric labels from config only."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.common.config import RouterConfig
from serve_app.common.errors import MeshError
from serve_app.common.wire import GenerateRequest
from serve_app.request.planner import UNKNOWN, RequestPlanner, session_key
from serve_app.request.split import pick_variant, splits_of
from tests.support.fakes import FakePlannerAvailability



def tenant(id_, n, **kw):
    return {"id": id_, "api_keys_sha256": [f"{n:064x}"], **kw}


CONFIG = RouterConfig.model_validate({
    "routes": {
        "smollm": {
            "variants": [{"application": "v1", "weight": 90}, {"application": "v2",
                                                                "weight": 10}],
            "adapters": {"acme": {"versions": [{"version": 1, "weight": 50},
                                               {"version": 2, "weight": 50}]}},
            "admission": {"queue_timeout_s": 7},
            "shadow": {"application": "v2", "percent": 5},
        },
        "other": {"variants": [{"application": "o1", "weight": 1}]},
    },
    "tenants": [tenant("ops", 1, admin=True), tenant("acme", 2, adapters=["acme"]),
                tenant("globex", 3, adapters=["globex"], routes=["smollm"]),
                tenant("batch", 4, priority=10)],
})
TENANTS = {t.id: t for t in CONFIG.tenants}


def planner(adapters=None, down=frozenset(), stale=frozenset()):
    splits = splits_of(CONFIG)
    return RequestPlanner(CONFIG, splits, lambda key, split: split.weighted,
                          FakePlannerAvailability(adapters if adapters is not None else {
                              "v1": {"acme@v1", "acme@v2", "globex@v1"},
                              "v2": {"acme@v1"}}, down, stale))


def plan(body, tenant_id="ops", p=None, **kw):
    return asyncio.run((p or planner()).plan("chat", body, TENANTS.get(tenant_id), **kw))


def refused(body, tenant_id="ops", **kw) -> MeshError:
    with pytest.raises(MeshError) as e:
        plan(body, tenant_id, **kw)
    return e.value


def test_base_model_plan_is_sticky_with_failover_order_and_route_settings():
    body = {"model": "smollm", "stream": True}
    p = plan(body, session_id="user-7", request_id="req-1")
    first = pick_variant([("v1", 90), ("v2", 10)], "smollm", "user-7")
    assert p.candidates == (first, "v2" if first == "v1" else "v1")
    assert (p.route, p.adapter, p.version) == ("smollm", "", None)
    # What every candidate's replica is sent, built once.
    assert p.request == GenerateRequest("chat", body, None, 0, "req-1",
                                        session=session_key("ops", "user-7"),
                                        queue_timeout_s=7.0)
    # The replica router's conversation: the header, else the OpenAI user; never the tenant.
    assert plan({"model": "smollm", "user": "u1"}).request.session == session_key("ops", "u1")
    assert plan({"model": "smollm"}).request.session is None
    # The route's settings travel in the plan: a deploy that changes or removes the route
    # while the request waits for its tenant slot cannot reach it.
    assert (p.shadow.application, p.shadow.percent) == ("v2", 5)
    assert plan({"model": "other"}).shadow is None
    assert p.arms == (("smollm", ""),)
    assert p.queue_timeout_s == 7 and p.priority == 0 and p.top_priority
    assert p.tags == {"route": "smollm", "variant": "", "tenant": "ops", "adapter": ""}
    # The `user` field is the identity when there is no session header.
    assert plan({"model": "smollm", "user": "user-7"}).candidates == p.candidates


def test_unavailable_variants_go_last():
    p = plan({"model": "smollm"}, p=planner(down={"v1"}), session_id="x")
    assert p.candidates[-1] == "v1"


def test_a_split_choice_that_may_have_gone_to_zero_is_checked_before_the_order():
    """The view says the canary is warm, but it idled and may be at zero (the last status
    poll is up to 5 s old): the planner refreshes first, then serves the caller elsewhere and
    wakes the canary, instead of sending it to a handle that waits for a cold start."""
    user = next(f"u{i}" for i in range(1000)
                if pick_variant([("v1", 90), ("v2", 10)], "smollm", f"u{i}") == "v2")
    p = planner(stale={"v2"})
    planned = plan({"model": "smollm"}, p=p, session_id=user)
    assert planned.candidates == ("v1", "v2") and planned.wake == "v2"
    assert p.availability.refreshes == 1
    assert plan({"model": "smollm"}, p=p, session_id=user).wake == "v2"  # no second refresh
    assert p.availability.refreshes == 1


def test_model_names():
    assert refused({"model": 7}).status == 400
    assert refused({}).param == "model"
    for model in ("gpt-9", "smollm:acme@v1"):
        e = refused({"model": model})
        assert (e.status, e.code) == (404, "model_not_found")


def test_tenancy_routes_adapters_and_pinning():
    assert refused({"model": "other"}, "globex").code == "model_not_allowed"
    assert refused({"model": "smollm:globex"}, "acme").code == "model_not_found"
    assert refused({"model": "smollm:nope"}, "acme").status == 404
    assert refused({"model": "smollm"}, "acme", pinned="v2").code == "pinning_not_allowed"
    assert refused({"model": "smollm"}, "ops", pinned="o1").code == "unknown_variant"
    pinned = plan({"model": "smollm"}, "ops", pinned="v2")
    assert pinned.candidates == ("v2",) and pinned.arms == ()  # not judged by a rollout


def test_adapter_versions_and_the_variants_that_serve_them():
    p = plan({"model": "smollm:acme"}, "acme", session_id="s1")
    expected = pick_variant([("acme@v1", 50), ("acme@v2", 50)], "smollm:acme", "s1")
    assert p.version == expected
    assert p.arms == (("smollm", ""), ("smollm:acme", expected))
    # acme@v2 is only on v1; acme@v1 is on both.
    assert set(p.candidates) == ({"v1"} if expected == "acme@v2" else {"v1", "v2"})
    # A version no variant serves falls back to one that is served, after a refresh.
    p2 = planner({"v1": {"acme@v1"}})
    assert plan({"model": "smollm:acme"}, "acme", p=p2, session_id="s1").version == "acme@v1"


def test_a_plan_under_the_last_config_reads_its_own_splits_while_the_next_is_applied():
    """CI's 500 KeyError (issue 28's promotion test): a ``serve deploy`` that drops an adapter
    split hands the rollout client the new splits while requests planned under the last
    config still run; their adapter split must still have weights."""
    from serve_app.control.rollout_client import RolloutClient
    client = RolloutClient(controller=None)
    client.splits = splits_of(RouterConfig.model_validate({"routes": {"smollm": {
        "variants": [{"application": "v1", "weight": 90}, {"application": "v2",
                                                            "weight": 10}]}}}))
    p = RequestPlanner(CONFIG, splits_of(CONFIG), client.weighted, FakePlannerAvailability(
        {"v1": {"acme@v1", "acme@v2"}, "v2": {"acme@v1"}}))
    assert plan({"model": "smollm:acme"}, "acme", p=p, session_id="s1").version in (
        "acme@v1", "acme@v2")


def test_unknown_adapter_is_refreshed_once_before_404():
    p = planner({"v1": set()})
    with pytest.raises(MeshError):
        plan({"model": "smollm:globex"}, "globex", p=p)
    assert p.availability.refreshes == 1


def test_priority_is_the_tenants_and_no_body_may_set_it():
    """A ``priority`` in the body is refused whatever its value, the tenant's own included
    (docs/traffic-safety.md): a client need not know its tenant's value to obey the rule."""
    batch = plan({"model": "smollm"}, "batch")
    assert (batch.priority, batch.request.priority, batch.top_priority) == (10, 10, False)
    assert plan({"model": "smollm"}, None).priority == 0
    for tenant_id, value in (("batch", 10), ("batch", 0), ("ops", 0), (None, 0),
                             ("batch", None)):
        e = refused({"model": "smollm", "priority": value}, tenant_id)
        assert (e.status, e.param, e.code) == (400, "priority", "priority_not_allowed")
        assert "remove it from the request" in e.message


def test_labels_come_from_the_config_only():
    p = planner()
    acme = TENANTS["acme"]
    assert p.labels(acme, {"model": "smollm:acme"})["adapter"] == "acme"
    for i in range(20):  # made-up names fold into one value each
        labels = p.labels(acme, {"model": f"smollm:junk-{i}"})
        assert labels == {"route": "smollm", "variant": "", "tenant": "acme",
                          "adapter": UNKNOWN}
        assert p.labels(None, {"model": f"nope-{i}:x"})["route"] == UNKNOWN
    assert p.labels(None, "not a dict") == {"route": "", "variant": "", "tenant": "",
                                            "adapter": ""}


def test_model_ids_per_tenant():
    p = planner()
    assert p.model_ids(TENANTS["acme"]) == ["smollm", "smollm:acme", "other"]
    assert p.model_ids(TENANTS["globex"]) == ["smollm", "smollm:globex"]
    assert p.model_ids(None) == ["smollm", "smollm:acme", "smollm:globex", "other"]


class MergedAvailability(FakePlannerAvailability):
    """v1 serves globex@v1 (its default) and globex@v2 by LoRA; g-merged's model holds
    globex@v1 merged in."""

    def __init__(self, merged="globex@v1", down=frozenset()):
        super().__init__({"v1": {"globex@v1", "globex@v2"}, "v2": set(),
                          "g-merged": {merged}}, down)
        self.merged_version = merged

    def is_available(self, application):
        return application not in self.down

    def version_for(self, application, adapter):
        return adapter if "@" in adapter else {"v1": "globex@v1"}.get(application)

    def merged(self, application):
        return self.merged_version if application == "g-merged" else ""


def merged_planner(availability, versions=None):
    route = {"variants": [{"application": "v1", "weight": 90},
                          {"application": "v2", "weight": 10}],
             "merged": {"globex": "g-merged"}}
    if versions:
        route["adapters"] = {"globex": {"versions": versions}}
    config = RouterConfig.model_validate({"routes": {"smollm": route},
                                          "tenants": CONFIG.model_dump()["tenants"]})
    splits = splits_of(config)
    return RequestPlanner(config, splits, lambda key, split: split.weighted, availability)


def test_an_adapter_with_a_merged_variant_goes_there_first_with_the_lora_path_as_failover():
    p = merged_planner(MergedAvailability())
    got = plan({"model": "smollm:globex"}, "globex", p)
    assert got.candidates == ("g-merged", "v1")  # v2 does not serve globex
    assert got.request.adapter_version == "globex@v1"  # both paths serve the same version
    # tenant isolation is unchanged: another tenant is refused before any variant is chosen,
    # with the answer an adapter no one owns gets (docs/tenants-and-adapters.md)
    with pytest.raises(MeshError) as e:
        plan({"model": "smollm:globex"}, "acme", p)
    no_one_s = refused({"model": "smollm:nope"}, "acme")
    assert (e.value.status, e.value.code) == (no_one_s.status, no_one_s.code) == (
        404, "model_not_found")
    assert e.value.message == no_one_s.message.replace("smollm:nope", "smollm:globex")
    # base-model traffic never goes to the merged variant
    assert "g-merged" not in plan({"model": "smollm"}, "globex", p).candidates


def test_the_merged_variant_is_skipped_when_it_holds_another_version_or_is_down():
    # the split gives this caller v2 of the adapter; the merged model holds v1
    p = merged_planner(MergedAvailability(), versions=[{"version": 2, "weight": 100},
                                                       {"version": 1, "weight": 0}])
    assert plan({"model": "smollm:globex"}, "globex", p).candidates == ("v1",)
    # the default version on the LoRA path is v1, but the merged model holds v2
    p = merged_planner(MergedAvailability(merged="globex@v2"))
    assert plan({"model": "smollm:globex"}, "globex", p).candidates == ("v1",)
    p = merged_planner(MergedAvailability(down={"g-merged"}))
    assert plan({"model": "smollm:globex"}, "globex", p).candidates == ("v1",)


def test_a_merged_variant_may_not_also_be_a_route_variant():
    with pytest.raises(ValueError, match="g-merged is also one of the route's variants"):
        RouterConfig.model_validate({"routes": {"smollm": {
            "variants": [{"application": "g-merged", "weight": 1}],
            "merged": {"globex": "g-merged"}}}})
    with pytest.raises(ValueError, match="without a version"):
        RouterConfig.model_validate({"routes": {"smollm": {
            "variants": [{"application": "v1", "weight": 1}],
            "merged": {"globex@v1": "g-merged"}}}})
