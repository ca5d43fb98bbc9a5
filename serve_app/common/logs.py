"""Loggers of the mesh's modules.

Serve installs its handlers (replica log files, stderr) on the ``ray.serve`` logger, so each
module logs through a child of it, ``ray.serve.<module>``: its lines go where Serve's go,
and a log line can name its module. The shipped Serve configs set
``logging_config.additional_log_standard_attrs: [name]``, which prints that name in Serve's
text format; Serve's JSON format (``encoding: JSON``) carries it as well.
"""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    """The logger of ``module`` (pass ``__name__``), e.g. ``ray.serve.serve_app.router``."""
    return logging.getLogger(f"ray.serve.{module}")
