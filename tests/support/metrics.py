"""Reads of the test cluster's Prometheus exposition (Ray's metrics export port)."""

from __future__ import annotations


def metric_total(mesh, name: str, **labels: str) -> float:
    """Sum of a Ray-exported series over the lines that carry ``labels``."""
    text = mesh.metrics_text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
