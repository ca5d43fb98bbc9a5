"""Which adapters carry the most tokens, and the config change that serves them from merged
weights (``meshctl top-adapters``).

One LoRA adapter costs a large share of the base model's throughput (LoRA kernels in every
layer of every batch that holds it; docs/tenants-and-adapters.md, "Hot adapters from merged
weights", gives the figure). A *merged variant*
runs a model with the adapter merged into its weights, at the base model's speed, and the
route sends that adapter's requests there first (``routes.<route>.merged``; the LoRA
variants are the failover). This module reads the router's own token counters
(``mesh_prompt_tokens`` + ``mesh_completion_tokens``, labelled ``route`` and ``adapter``),
ranks the adapters, and writes the change for the top ones: the merged model to build, the
variant application to add, and the route entry. It deploys nothing: the change goes through
review and ``serve deploy`` like any other.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from serve_app.common.adapters import MODEL_STAMP, adapter_key, merged_adapter
from serve_app.common.paths import model_identity, models_dir
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment, mesh_parts

TOKEN_SERIES = ("ray_mesh_prompt_tokens_total", "ray_mesh_completion_tokens_total")
#: Engine arguments of LoRA that a merged variant, which loads no adapter, leaves out.
LORA_ENGINE_ARGS = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")


def adapter_tokens(metrics_text: str) -> Counter:
    """``(route, adapter) -> prompt + completion tokens`` from Prometheus-format text (a Ray
    node's metrics export, ``http://<node>:8080/metrics``, or a Prometheus federation
    dump); the base model's requests (``adapter=""``) are left out.

    Raises:
        ValueError: the text is not in Prometheus's text format.
    """
    tokens: Counter = Counter()
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name in TOKEN_SERIES and sample.labels.get("adapter"):
                    tokens[(sample.labels.get("route", ""), sample.labels["adapter"])] += \
                        sample.value
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"not Prometheus metrics in text format ({type(e).__name__}: "
                         f"{e})") from None
    return tokens


def not_mergeable(config: dict[str, Any], route: str, adapter: str) -> str | None:
    """Why ``route:adapter`` gets no merged variant from :func:`plan_merges`, or None."""
    routes = (mesh_parts(config).router_user_config or {}).get("routes", {})
    rc = routes.get(route)
    if rc is None:
        return f"route {route!r} is not in this config"
    if adapter in rc.get("merged", {}):
        return f"it has a merged variant already ({rc['merged'][adapter]})"
    if _lora_variant(mesh_parts(config), rc, adapter) is None:
        return f"no variant of route {route!r} declares it in this config"
    return None


@dataclass(frozen=True)
class MergeStep:
    """One adapter to serve from merged weights.

    Attributes:
        route, adapter: the adapter as clients call it (``route:adapter``).
        version: the version (``name@vN``) the route's LoRA variants serve by default.
        application: the merged variant application to add.
        model: its ``args.model``.
        build: the command that builds that model, or "" when it exists already.
    """

    route: str
    adapter: str
    version: str
    application: str
    model: str
    build: str


def _existing_merged_model(version: str) -> str | None:
    """A prepared model under :func:`models_dir` whose stamp says ``version`` is merged in."""
    root = models_dir()
    for stamp in sorted(root.glob(f"*/{MODEL_STAMP}")) if root.is_dir() else []:
        if merged_adapter(stamp.parent.name) == version:
            return stamp.parent.name
    return None


def plan_merges(config: dict[str, Any], tokens: Counter, top: int
                ) -> tuple[dict[str, Any], list[MergeStep]]:
    """The config with the ``top`` adapters by tokens served from merged variants, and the
    steps it takes. Adapters that already have a merged variant, or that no variant of their
    route declares, are skipped.

    Raises:
        ValueError: ``top`` < 1, or the config has no mesh router.
    """
    if top < 1:
        raise ValueError(f"--top must be >= 1, not {top}")
    new = copy.deepcopy(config)
    parts = mesh_parts(new)
    if parts.router_user_config is None:
        raise ValueError("no mesh router application (serve_app.router:build_app) with a "
                         "user_config in this config")
    routes = parts.router_user_config.get("routes", {})
    steps: list[MergeStep] = []
    for (route, adapter), _ in tokens.most_common():
        if len(steps) == top:
            break
        if not_mergeable(new, route, adapter):
            continue
        rc = routes[route]
        app, version = _lora_variant(parts, rc, adapter)
        name = f"{route}-{adapter}-merged"
        base = model_identity(app["args"]["model"])
        existing = _existing_merged_model(version)
        model = existing or f"{base}-{adapter}-v{version.rsplit('@v', 1)[1]}"
        build = "" if existing else (
            f"python scripts/prepare_model.py --merge-adapter {version} --out models/{model}")
        new["applications"].append(_merged_app(app, name, model))
        rc.setdefault("merged", {})[adapter] = name
        steps.append(MergeStep(route, adapter, version, name, model, build))
    return new, steps


def _lora_variant(parts, rc: dict, adapter: str) -> tuple[dict, str] | None:
    """The first variant of the route that declares ``adapter``, and its default version
    (the first one listed, as the replica's adapter set takes it)."""
    for v in rc.get("variants", []):
        app = parts.variant_apps.get(v.get("application"))
        dep = deployment(app, REPLICA_DEPLOYMENT) if app else None
        for ref in ((dep or {}).get("user_config") or {}).get("adapters", []):
            if ref.get("name") == adapter:
                return app, adapter_key(adapter, ref["version"])
    return None


def _merged_app(source: dict, name: str, model: str) -> dict:
    """A copy of the LoRA variant's application that runs ``model`` with no LoRA: one
    replica, its ``system_prompt`` kept, no adapters."""
    app = copy.deepcopy(source)
    app["name"] = name
    app["args"]["model"] = model
    engine = app["args"].get("engine_args") or {}
    for key in LORA_ENGINE_ARGS:
        engine.pop(key, None)
    dep = deployment(app, REPLICA_DEPLOYMENT)
    uc = dep.get("user_config") or {}
    dep["user_config"] = {k: v for k, v in uc.items() if k == "system_prompt"}
    dep["num_replicas"] = 1
    dep.pop("request_router_config", None)
    return app


def format_table(tokens: Counter, steps: list[MergeStep], limit: int = 20) -> list[str]:
    """The ranking as lines: rank, ``route:adapter``, tokens, share of all adapter tokens,
    and what the plan does with it."""
    total = sum(tokens.values()) or 1
    planned = {(s.route, s.adapter): s for s in steps}
    lines = [f"{'#':>3}  {'route:adapter':<40} {'tokens':>12} {'share':>6}  plan"]
    for i, ((route, adapter), n) in enumerate(tokens.most_common(limit), 1):
        s = planned.get((route, adapter))
        lines.append(f"{i:>3}  {route + ':' + adapter:<40} {n:>12,.0f} {n / total:>6.1%}  "
                     + (f"merge {s.version} -> {s.application}" if s else "-"))
    return lines
