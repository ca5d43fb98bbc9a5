"""Unit tests of the per-tenant limiter (no Ray): concurrency and requests-per-minute."""

from __future__ import annotations

import pytest

import serve_app.ingress.limits as limits
from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError
from serve_app.ingress.limits import TenantLimiter


def tenant(**kw) -> Tenant:
    return Tenant(id="t", api_keys_sha256=["0" * 64], **kw)


def test_concurrency_limit_and_release():
    t, limiter = tenant(max_concurrent_requests=2), TenantLimiter()
    limiter.acquire(t)
    limiter.acquire(t)
    with pytest.raises(MeshError) as e:
        limiter.acquire(t)
    assert (e.value.status, e.value.code) == (429, "concurrency_limit_exceeded")
    assert e.value.headers == {"Retry-After": "1"}
    limiter.release(t)
    limiter.acquire(t)  # a slot is free again


def test_requests_per_minute_is_a_token_bucket(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    t, limiter = tenant(requests_per_minute=3), TenantLimiter()
    for _ in range(3):  # a full bucket: a burst of 3
        limiter.acquire(t)
        limiter.release(t)
    with pytest.raises(MeshError) as e:
        limiter.acquire(t)
    assert (e.value.status, e.value.code) == (429, "rate_limit_exceeded")
    assert e.value.headers == {"Retry-After": "20"}  # one token every 60 / 3 s
    now[0] += 20
    limiter.acquire(t)


def test_open_mode_and_unlimited_tenants_pass():
    limiter = TenantLimiter()
    for _ in range(100):
        limiter.acquire(None)
        limiter.acquire(tenant())
