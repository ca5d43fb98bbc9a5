"""Adapter names a caller can and cannot learn or use (no Ray: Serve's status and deployment
details faked, the real availability view and planner).

- A variant asleep since the router started answers only for the adapters its deployed
  ``user_config`` declares: before, ``serves()`` said yes to any name, so any tenant could
  plan an adapter no one owns (refused only once the replica reported), and any string up
  to the body limit became the ``adapter`` metric label.
- A tenant asking for an adapter it does not own gets the answer a name no one owns gets:
  404 ``model_not_found``, same message; before, 403 told it another tenant's existed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import serve_app.variants.serve_view as serve_view
from serve_app.common.config import RouterConfig
from serve_app.common.errors import MeshError
from serve_app.variants.availability import VariantAvailability
from serve_app.request.planner import UNKNOWN, RequestPlanner
from serve_app.request.split import splits_of
from tests.support.fakes import status_of

CONFIG = RouterConfig.model_validate({
    "routes": {"smollm": {"variants": [{"application": "v1", "weight": 1},
                                       {"application": "v2", "weight": 0}]}},
    "tenants": [{"id": "acme", "api_keys_sha256": ["1" * 64], "adapters": ["acme"]},
                {"id": "globex", "api_keys_sha256": ["2" * 64], "adapters": ["globex"]}]})
TENANTS = {t.id: t for t in CONFIG.tenants}


def details(declared: dict[str, list[dict]]) -> dict:
    """Deployment details: every variant scales to zero; ``declared``: its adapters."""
    return {"applications": {app: {"deployments": {"LLMReplica": {"deployment_config": {
        "autoscaling_config": {"min_replicas": 0, "max_replicas": 1},
        "user_config": {"adapters": adapters}}}}} for app, adapters in declared.items()}}


@pytest.fixture
def asleep(monkeypatch) -> VariantAvailability:
    """v1 and v2 at zero since the router started (never polled): v1 declares acme@v1 and
    globex@v2, v2 declares nothing."""
    monkeypatch.setattr(serve_view.serve, "status", lambda: status_of({"v1": {}, "v2": {}}))
    monkeypatch.setattr(serve_view, "serve_details", lambda: details({
        "v1": [{"name": "acme", "version": 1}, {"name": "globex", "version": 2}], "v2": []}))
    view = VariantAvailability(lambda app: None)
    asyncio.run(view.refresh())
    assert view.is_asleep("v1") and "v1" not in view.adapters  # nothing reported yet
    return view


def planner(view) -> RequestPlanner:
    return RequestPlanner(CONFIG, splits_of(CONFIG), lambda key, split: split.weighted, view)


def test_a_variant_asleep_since_the_start_serves_what_its_config_declares_only(asleep):
    assert asleep.serves("v1", "acme") and asleep.serves("v1", "acme@v1")
    assert asleep.serves("v1", "globex@v2") and not asleep.serves("v1", "globex@v1")
    for name in ("nobody", "acme@v2", "x" * 10_000):
        assert not asleep.serves("v1", name)
    assert not asleep.serves("v2", "acme")


def test_in_open_mode_an_adapter_no_variant_declares_is_404_and_labelled_unknown(asleep):
    open_config = CONFIG.model_copy(update={"tenants": []})
    p = RequestPlanner(open_config, splits_of(open_config), lambda key, split: split.weighted,
                       asleep)
    assert asyncio.run(p.plan("chat", {"model": "smollm:acme"}, None)).candidates[0] == "v1"
    junk = "junk-" + "x" * 10_000
    with pytest.raises(MeshError) as e:
        asyncio.run(p.plan("chat", {"model": f"smollm:{junk}"}, None))
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    # What the refused request is counted under: never the client's string.
    assert p.labels(None, {"model": f"smollm:{junk}"})["adapter"] == UNKNOWN
    assert p.labels(None, {"model": "smollm:globex"})["adapter"] == "globex"  # declared


def test_another_tenant_s_adapter_and_no_one_s_get_the_same_404(asleep):
    p = planner(asleep)

    def answer(model: str, tenant: str) -> tuple[int, str, str, str]:
        with pytest.raises(MeshError) as e:
            asyncio.run(p.plan("chat", {"model": model}, TENANTS[tenant]))
        return (e.value.status, e.value.code, e.value.param,
                e.value.message.replace(model, "<model>"))

    theirs = answer("smollm:globex", "acme")  # globex's, declared on v1
    no_ones = answer("smollm:nobody", "acme")
    assert theirs == no_ones == (404, "model_not_found", "model", theirs[3])
    assert asyncio.run(p.plan("chat", {"model": "smollm:globex"}, TENANTS["globex"])).adapter
