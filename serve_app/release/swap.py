"""Blue/green release of a route's new base model or engine args, as a series of Serve
configs (``meshctl swap``).

A new base model or new engine args change a variant application's ``args``, and Serve
replaces every replica of an application whose ``args`` change (see
:mod:`serve_app.release.config_diff`). So the new ``args`` go into a *new* variant
application, and the route's traffic moves to it by weight:

1. ``add``: the new variant application is added to the config and to the route with
   weight 0. Serve starts its replicas; nothing else changes.
2. ``weight-<N>`` for each step N (e.g. 50, 100): the new variant gets weight N and the old
   one 100 - N. The router applies weights in place (``reconfigure()``).
3. ``retire``: the old variant(s) leave the route and their applications leave the config.
   The router stopped choosing them at step 100; Serve lets their in-flight requests finish
   (``graceful_shutdown_timeout_s``), then stops them.

The new variant copies the old variant's application (``args``, engine args,
``runtime_env``, deployments and their ``user_config``) with another ``args.model`` and/or
some engine args changed. Every config of the plan must pass
:func:`serve_app.release.validate.validate_config` before any is applied: a model directory
that is not there fails, and so do adapters declared on the old variant that were trained
for the old base.

The last config of the plan is the new desired state, to commit in place of the old file.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serve_app.release.deploy import DeployError, deploy
from serve_app.common.serve_configs import REPLICA_DEPLOYMENT, deployment, mesh_parts
from serve_app.common.deployment_options import SURGE_PERCENT
from serve_app.release.validate import validate_config


class SwapError(ValueError):
    """The swap cannot be planned: bad arguments (a route, application or step that does not
    fit the config)."""


class InvalidPlan(SwapError):
    """A generated config of the plan is invalid (the message lists every problem)."""


@dataclass
class SwapStep:
    """One config of a swap plan.

    Attributes:
        name: ``add``, ``weight-<N>`` or ``retire`` (file ``<NN>-<name>.yaml``).
        config: the whole Serve config to deploy (a new dict).
        weights: the route's variant application -> weight in this config.
        pause_after: wait ``pause_s`` after deploying it (the weight steps).
    """

    name: str
    config: dict[str, Any]
    weights: dict[str, int]
    pause_after: bool = False

    def filename(self, index: int) -> str:
        """``01-add.yaml`` for index 0."""
        return f"{index + 1:02d}-{self.name}.yaml"


def parse_steps(text: str) -> list[int]:
    """``"10,50,100"`` -> ``[10, 50, 100]``.

    Raises:
        SwapError: not integers, not strictly increasing in 1..100, or not ending at 100.
    """
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SwapError(f"--steps {text!r}: give comma-separated integer percentages, "
                        "e.g. 10,50,100") from None
    if (not steps or any(not 1 <= s <= 100 for s in steps)
            or any(b <= a for a, b in zip(steps, steps[1:])) or steps[-1] != 100):
        raise SwapError(f"--steps {text!r}: need strictly increasing percentages in 1..100 "
                        "that end at 100 (the new variant takes all traffic before the old "
                        "one retires), e.g. 50,100 or 100")
    return steps


def plan_swap(config: dict[str, Any], *, route: str, new_app: str, model: str | None = None,
              engine_args: dict[str, Any] | None = None, steps: Sequence[int] = (100,),
              from_app: str | None = None) -> list[SwapStep]:
    """The Serve configs that move ``route`` onto a new variant ``new_app`` serving ``model``
    with ``engine_args``.

    Args:
        config: the Serve config deployed now (not modified).
        route: the route to swap (a key of the router's ``user_config.routes``).
        new_app: name of the new variant application; must not exist in ``config``.
        model: the new variant's ``args.model``; None keeps the copied variant's.
        engine_args: engine args to set on the new variant (``None`` as a value removes
            one); the others are the copied variant's.
        steps: weight percentages of the new variant, increasing, ending at 100
            (see :func:`parse_steps`).
        from_app: the variant application to copy; default the route's only variant with a
            positive weight.

    Returns:
        ``add``, one ``weight-<N>`` per step, ``retire``: each a full, valid config.

    Raises:
        SwapError: the route or an application is missing or ambiguous, the route is under a
            progressive rollout, or nothing would change.
        InvalidPlan: a generated config fails validation (the message lists every problem
            of every step).
    """
    parts = mesh_parts(config)
    routes = (parts.router_user_config or {}).get("routes") or {}
    if route not in routes:
        raise SwapError(f"route {route!r} is not in the router's user_config.routes "
                        f"(routes: {', '.join(routes) or 'none'})")
    if routes[route].get("rollout") is not None:
        raise SwapError(f"route {route!r} has a progressive rollout (routes.{route}.rollout); a "
                        "swap would fight it over the weights: finish or abort the rollout and "
                        "remove its `rollout:` key, or release the new variant with the rollout")
    variants = routes[route].get("variants") or []
    serving = [v["application"] for v in variants if v.get("weight", 0) > 0]
    if len(serving) != 1:
        raise SwapError(f"route {route!r} has {len(serving)} variants with a positive weight "
                        f"({', '.join(serving) or 'none'}); a swap starts from exactly one: "
                        "finish the canary release first")
    old = [v["application"] for v in variants]
    source = from_app or serving[0]
    if source not in parts.variant_apps:
        raise SwapError(f"--from-app {source!r} is not a variant application of this config "
                        f"(variants: {', '.join(parts.variant_apps) or 'none'})")
    if new_app in parts.app_index:
        raise SwapError(f"application {new_app!r} already exists in the config; choose a new "
                        "name for the new variant (e.g. smollm-v2)")

    app = copy.deepcopy(parts.variant_apps[source])
    app["name"] = new_app
    args = dict(app.get("args") or {})
    old_args = copy.deepcopy(args)
    if model is not None:
        args["model"] = model
    if engine_args:
        engine = dict(args.get("engine_args") or {})
        for key, value in engine_args.items():
            if value is None:
                engine.pop(key, None)
            else:
                engine[key] = value
        args["engine_args"] = engine
    if args == old_args:
        raise SwapError(f"the new variant would run {source!r}'s args unchanged; give a new "
                        "--model or --engine-arg KEY=VALUE (a change of replicas, autoscaling "
                        "or user_config needs no swap: Serve applies it in place)")
    app["args"] = args
    model = args.get("model", model)
    replica = deployment(app, REPLICA_DEPLOYMENT)
    if replica is None:
        replica = {"name": REPLICA_DEPLOYMENT}
        app.setdefault("deployments", []).append(replica)
    # A later `args` change of the new variant then starts its replacement first, too.
    replica.setdefault("max_surge_percent", SURGE_PERCENT)

    def variant_config(weights: dict[str, int], *, retire: bool = False) -> dict[str, Any]:
        cfg = copy.deepcopy(config)
        apps = cfg["applications"]
        if retire:
            apps[:] = [a for a in apps if a.get("name") not in old]
        apps.append(copy.deepcopy(app))
        mesh_parts(cfg).router_user_config["routes"][route]["variants"] = [
            {"application": a, "weight": w} for a, w in weights.items()]
        return cfg

    before = {v["application"]: v.get("weight", 0) for v in variants}
    plan = [SwapStep("add", variant_config({**before, new_app: 0}), {**before, new_app: 0})]
    for step in steps:
        weights = {a: (100 - step if a == serving[0] else 0) for a in old} | {new_app: step}
        plan.append(SwapStep(f"weight-{step}", variant_config(weights), weights,
                             pause_after=True))
    plan.append(SwapStep("retire", variant_config({new_app: 100}, retire=True), {new_app: 100}))

    invalid = [(s.filename(i), problems) for i, s in enumerate(plan)
               if (problems := validate_config(s.config))]
    if invalid:
        (first, problems), rest = invalid[0], invalid[1:]
        raise InvalidPlan(
            f"the swap of route {route!r} to {new_app!r} (model {model!r}) gives invalid "
            f"configs; nothing was applied. {first}:\n  " + "\n  ".join(problems)
            + ("\nalso invalid: " + ", ".join(f"{f} ({len(p)} problems)" for f, p in rest)
               if rest else "")
            + f"\nThe new variant copies args and user_config from {source!r}. Fix them in the "
              "config (adapters trained for the old base cannot follow to a new base: drop them "
              f"from its adapters: list, or register versions trained for {model!r}), or choose "
              "another variant with --from-app, then run the swap again.")
    return plan


def write_plan(plan: list[SwapStep], out_dir: str | Path) -> list[Path]:
    """Write the plan's configs as ``<out_dir>/01-add.yaml``, ``02-weight-50.yaml``, ...;
    return their paths in order (the last is the new desired state)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, s in enumerate(plan):
        path = out / s.filename(i)
        path.write_text(yaml.safe_dump(s.config, sort_keys=False))
        paths.append(path)
    return paths


def apply_plan(plan: list[SwapStep], dashboard: str, *, pause_s: float = 10,
               out_dir: str | Path | None = None, timeout_s: float = 900,
               log: Callable[[str], None] = print) -> Path:
    """Write the plan (into ``out_dir`` or a new temporary directory) and apply it step by
    step with :func:`serve_app.release.deploy.deploy` (``serve deploy`` + wait until every application
    is RUNNING and removed ones are gone), pausing ``pause_s`` seconds after each weight step.

    Returns:
        The path of the last config (the new desired state).

    Raises:
        serve_app.release.deploy.DeployError: a step failed; the steps before it stay applied (the
            message says which step to resume from).
    """
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="meshctl-swap-"))
    paths = write_plan(plan, out)
    log(f"[swap] plan of {len(plan)} configs in {out}")
    for i, (s, path) in enumerate(zip(plan, paths)):
        weights = ", ".join(f"{a}={w}" for a, w in s.weights.items())
        log(f"[swap] {i + 1}/{len(plan)} {s.name}: {weights}")
        t0 = time.monotonic()
        try:
            deploy(path, dashboard, timeout_s=timeout_s, log=lambda m: log(f"[swap]   {m}"))
        except DeployError as e:
            raise DeployError(f"step {s.filename(i)} failed: {e}\nsteps before it are applied; "
                              f"fix the cause and resume with: serve deploy {path}") from None
        log(f"[swap]   applied in {time.monotonic() - t0:.1f} s")
        if s.pause_after and pause_s > 0:
            log(f"[swap]   pausing {pause_s:g} s")
            time.sleep(pause_s)
    log(f"[swap] done; the new desired state is {paths[-1]}: commit it in place of the old "
        "config")
    return paths[-1]
