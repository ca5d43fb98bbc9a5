"""Who is calling: API key -> tenant, and what the tenant may do.

Keys are compared by SHA-256 digest only (configs never hold keys). With no tenants
configured the mesh runs in open mode: every caller is anonymous and no one is admin.
"""

from __future__ import annotations

import hashlib

from serve_app.common.config import Tenant
from serve_app.common.errors import MeshError


def hash_api_key(key: str) -> str:
    """SHA-256 hex digest of an API key, as stored in ``tenants[].api_keys_sha256``."""
    return hashlib.sha256(key.encode()).hexdigest()


def authenticate(by_digest: dict[str, Tenant], authorization: str | None) -> Tenant | None:
    """The tenant of an ``Authorization: Bearer <key>`` header.

    Returns ``None`` in open mode (``by_digest`` empty).

    Raises:
        MeshError: 401 when tenants are configured and the key is missing or unknown.
    """
    if not by_digest:
        return None
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise MeshError(401, "missing API key: send `Authorization: Bearer <key>`",
                        code="invalid_api_key")
    tenant = by_digest.get(hash_api_key(key.strip()))
    if tenant is None:
        raise MeshError(401, "invalid API key", code="invalid_api_key")
    return tenant
