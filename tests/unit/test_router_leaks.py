"""What the router's own endpoints tell whom (no Ray: ``MeshRouter``'s methods on an object
with the state they read set by hand, as Serve's constructor needs a cluster).

- ``GET /health`` without an admin key used to list the adapter split keys and weights
  (``route:adapter`` names are their tenants' own): anonymous callers and non-admin tenants
  now get the status and per-route availability only; admins, and everyone in open mode
  (no tenants, ``GET /v1/models`` lists every adapter to anyone), get the whole view.
- In open mode ``/admin/*`` (kept shadow prompts included) answered anyone: open mode has
  no admin, so it is 403 ``admin_only`` with how to get one.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from serve_app.common.config import RouterConfig
from serve_app.common.errors import MeshError
from serve_app.router import MeshRouter
from serve_app.tenancy.keys import hash_api_key

# Serve's ingress wrapper has an async __del__, never awaited for an object made by hand.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ROUTES = {"smollm": {"variants": [{"application": "smollm-v1", "weight": 90},
                                  {"application": "smollm-v2", "weight": 10}],
                     "adapters": {"acme-secret": {"versions": [{"version": 1, "weight": 1},
                                                               {"version": 2, "weight": 1}]}}},
          "other": {"variants": [{"application": "other-v1", "weight": 1}]}}
TENANTS = [{"id": "ops", "api_keys_sha256": [hash_api_key("sk-ops")], "admin": True},
           {"id": "acme", "api_keys_sha256": [hash_api_key("sk-acme")],
            "adapters": ["acme-secret"]}]


def router(tenants: list[dict]) -> MeshRouter:
    r = object.__new__(MeshRouter)
    r.config = RouterConfig.model_validate({"routes": ROUTES, "tenants": tenants})
    r._tenants = r.config.tenant_by_key_digest()
    r.availability = SimpleNamespace(is_available=lambda a: a != "other-v1",
                                     is_asleep=lambda a: False, states=lambda: {})
    r.rollouts = SimpleNamespace(weights=lambda: {
        "smollm": {"smollm-v1": 90, "smollm-v2": 10}, "other": {"other-v1": 1},
        "smollm:acme-secret": {"acme-secret@v1": 1, "acme-secret@v2": 1}})
    r.variants = SimpleNamespace(budget=SimpleNamespace(status=lambda: None))
    r.controller = SimpleNamespace(
        snapshot=SimpleNamespace(remote=lambda: _answer({"smollm": {"state": "idle"}})),
        shadow_snapshot=SimpleNamespace(remote=lambda: _answer({})))
    r.shadows = SimpleNamespace(status=lambda book: {"kept": ["a prompt"]})
    return r


async def _answer(value):
    return value


def request(key: str | None = None) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})


def health(r: MeshRouter, key: str | None = None) -> dict:
    return asyncio.run(r.health(request(key)))


@pytest.mark.parametrize("key", [None, "sk-acme", "sk-wrong", "\xff"])
def test_health_shows_no_adapter_or_variant_name_to_a_non_admin(key):
    body = health(router(TENANTS), key)
    assert body == {"status": "ok", "open_mode": False,
                    "routes_available": {"smollm": True, "other": False}}
    assert "acme-secret" not in repr(body) and "smollm-v1" not in repr(body)


def test_health_shows_everything_to_an_admin_and_in_open_mode():
    for body in (health(router(TENANTS), "sk-ops"), health(router([]))):
        assert body["adapters"] == {"smollm:acme-secret": {"acme-secret@v1": 1,
                                                           "acme-secret@v2": 1}}
        assert body["routes"]["smollm"] == {"smollm-v1": 90, "smollm-v2": 10}
        assert body["available"] == {"other-v1": False, "smollm-v1": True, "smollm-v2": True}
        assert body["routes_available"] == {"smollm": True, "other": False}


@pytest.mark.parametrize("endpoint", ["rollout_status", "shadow_status", "adapter_status"])
def test_open_mode_has_no_admin(endpoint):
    with pytest.raises(MeshError) as e:
        asyncio.run(getattr(router([]), endpoint)(request()))
    assert (e.value.status, e.value.code) == (403, "admin_only")
    assert "tenants:" in e.value.message and "admin" in e.value.message


def test_an_admin_tenant_still_reads_admin_endpoints():
    r = router(TENANTS)
    assert asyncio.run(r.rollout_status(request("sk-ops"))) == {"smollm": {"state": "idle"}}
    assert asyncio.run(r.shadow_status(request("sk-ops"))) == {"kept": ["a prompt"]}
    with pytest.raises(MeshError) as e:
        asyncio.run(r.shadow_status(request("sk-acme")))
    assert (e.value.status, e.value.code) == (403, "admin_only")
