"""The demo tenants of serve_configs/ (their API keys), the adapter versions they own, and how
each one's answers open on the module's engine; and a tenant for unit tests that build no
config (:func:`tenant`)."""

from __future__ import annotations

import hashlib

from serve_app.common.config import Tenant
from tests.support.engines import signature

#: API keys of the demo tenants (serve_configs/tenants.yaml and the configs built on it).
KEYS = {"ops": "sk-mesh-ops-demo", "acme": "sk-acme-demo", "globex": "sk-globex-demo",
        "initech": "sk-initech-demo"}
ACME_V1, ACME_V2, GLOBEX = "acme-support@v1", "acme-support@v2", "globex-report@v1"


def sig(mesh, who: str) -> str:
    """How ``who``'s answers open on this module's engine (:func:`~tests.support.engines.signature`)."""
    return signature(mesh.engine, who)


def tenant(id: str = "t", **fields) -> Tenant:
    """Tenant ``id`` with ``fields`` (its limits, ``limits_fail_mode``, ``priority``...) and
    one key, whose SHA-256 is that of ``id`` (no two tenants share one)."""
    return Tenant(id=id, api_keys_sha256=[hashlib.sha256(id.encode()).hexdigest()], **fields)
