"""Loggers of the mesh's modules.

Serve installs its handlers (replica log files, stderr) on the ``ray.serve`` logger, so each
module logs through a child of it, ``ray.serve.<module>``: its lines go where Serve's go,
and each record names its module (``record.name``). Serve's JSON log encoding carries it; to
see it in the text format too, add ``logging_config: {additional_log_standard_attrs: [name]}``
to an application in the Serve config. The shipped configs leave Serve's logging as it is:
a top-level ``logging_config`` also reconfigures Serve's proxies.
"""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    """The logger of ``module`` (pass ``__name__``), e.g. ``ray.serve.serve_app.router``."""
    return logging.getLogger(f"ray.serve.{module}")
