"""Parts of a Serve config file (serve_configs/*.yaml, loaded): the router's ``user_config``."""

from __future__ import annotations

from typing import Any


def router_uc(cfg: dict[str, Any]) -> dict[str, Any]:
    """The router's ``user_config`` in ``cfg`` (application ``mesh``, its one deployment)."""
    return cfg["applications"][0]["deployments"][0]["user_config"]
