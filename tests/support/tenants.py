"""The demo tenants of serve_configs/ (their API keys), the adapter versions they own, and how
each one's answers open on the module's engine."""

from __future__ import annotations

from tests.support.engines import signature

#: API keys of the demo tenants (serve_configs/tenants.yaml and the configs built on it).
KEYS = {"ops": "sk-mesh-ops-demo", "acme": "sk-acme-demo", "globex": "sk-globex-demo",
        "initech": "sk-initech-demo"}
ACME_V1, ACME_V2, GLOBEX = "acme-support@v1", "acme-support@v2", "globex-report@v1"


def sig(mesh, who: str) -> str:
    """How ``who``'s answers open on this module's engine (:func:`~tests.support.engines.signature`)."""
    return signature(mesh.engine, who)
