"""The Grafana dashboard's builder (dashboards/build.py), loaded as a module."""

from __future__ import annotations

import importlib.util

from serve_app.common.paths import REPO_ROOT


def dashboard():
    """dashboards/build.py as a module."""
    spec = importlib.util.spec_from_file_location("build", REPO_ROOT / "dashboards" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build
