"""Numbers in the router config are bounded and finite, and names are matched whole: a value
that validated but failed on every request (an OverflowError from a weight or a budget of
10**400), an ``.inf`` queue bound, or a route named ``"smollm\\n"`` is refused at deploy time
with the field's path, and the last good config keeps serving."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from serve_app.common.config import RouterConfig
from serve_app.request.split import pick_variant, splits_of

DIGEST = "0" * 64


def config(route: str = "smollm", weight: int = 1, admission: dict | None = None,
           **tenant) -> dict:
    return {"routes": {route: {"variants": [{"application": "v1", "weight": weight}],
                               "admission": admission or {}}},
            "tenants": [{"id": "acme", "api_keys_sha256": [DIGEST], **tenant}]}


def refusal(cfg: dict) -> str:
    with pytest.raises(ValidationError) as e:
        RouterConfig.model_validate(cfg)
    return str(e.value)


@pytest.mark.parametrize("cfg, field", [
    (config(weight=10**400), "routes.smollm.variants.0.weight"),
    (config(tokens_per_day=10**400), "tenants.0.tokens_per_day"),
    (config(tokens_per_minute=10**400), "tenants.0.tokens_per_minute"),
    (config(requests_per_minute=10**400), "tenants.0.requests_per_minute"),
    (config(max_concurrent_requests=10**400), "tenants.0.max_concurrent_requests"),
    (config(admission={"max_queued_per_slot": math.inf}), "max_queued_per_slot"),
    (config(admission={"max_queued_per_slot": math.nan}), "max_queued_per_slot"),
    (config(admission={"reserved_slots": 10**400}), "reserved_slots"),
])
def test_an_unbounded_or_infinite_number_is_refused_with_its_field(cfg, field):
    assert field in refusal(cfg)


def test_the_largest_accepted_figures_stay_finite_per_request():
    """What the bounds let through works: the split and the token bucket on the largest
    values compute finite figures (10**400 raised OverflowError on every request)."""
    from serve_app.common.config import MAX_TOKENS_BUDGET, MAX_WEIGHT
    from serve_app.tenancy.counts import TenantCounts
    from serve_app.tenancy.quota import Limits

    cfg = RouterConfig.model_validate(config(weight=MAX_WEIGHT, tokens_per_day=MAX_TOKENS_BUDGET))
    assert pick_variant(splits_of(cfg)["smollm"].weighted, "smollm", "caller") == "v1"
    refusal_, quota = TenantCounts().acquire("acme", Limits.of(cfg.tenants[0]), 100)
    assert refusal_ is None and quota.tokens[1] == MAX_TOKENS_BUDGET - 100


@pytest.mark.parametrize("cfg, what", [
    (config(route="smollm\n"), "route name"),
    ({"routes": {"smollm": {"variants": [{"application": "v1", "weight": 1}]}},
      "tenants": [{"id": "acme", "api_keys_sha256": [DIGEST + "\n"]}]}, "SHA-256"),
    (config(adapters=["acme-support\n"]), "adapter name"),
])
def test_a_name_with_a_trailing_newline_is_refused(cfg, what):
    assert what in refusal(cfg)
