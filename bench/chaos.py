"""The chaos drill: changes and kills in turn under steady load, and what each one cost.

Four client loops send back to back (through the OpenAI HTTP API): a base-model stream, a
base-model non-stream, tenant acme's adapter as a stream, tenant globex's adapter as a
non-stream. Every ``period_s`` one event happens, the kinds of :data:`EVENTS` in turn:

- changes, each applied with ``serve deploy`` and undone by its next turn: the canary's
  weights (90/10 <-> 80/20), acme's adapter version flipped in place on both variants (v1 <->
  v2), the canary's system prompt, acme's ``max_concurrent_requests``, globex's adapter
  removed from the canary and added back;
- kills (SIGKILL, as a crash or the OOM killer): a variant replica (the stable and the canary
  in turn), a router replica, the ledger actor.

Each request is counted in the window of the event before it started; a kill also counts
what was in flight at the kill. The mesh's promises (docs/traffic-safety.md, "Faults"),
checked per window by :func:`verdicts`:

- a change loses nothing: 0 failed in its window;
- a killed variant replica loses only its streams then in flight (each ends with an in-band
  error event); its non-streams fail over before any byte, so no non-stream fails;
- a killed router replica loses only what was in flight on the mesh at the kill, and a
  request started after the kill is answered within :data:`SERVICE_BACK_S`;
- a killed ledger refuses nobody: 0 failed.

Needs ``ray.init`` connected to the cluster (to find the processes to kill) and the mesh on
this host. Used by ``tests/integration/test_chaos.py`` (simulated engine in the default tier,
real engines under ``--all``) and ``python scripts/bench.py --chaos`` (the long soak).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from serve_app.common.serve_configs import (REPLICA_DEPLOYMENT, ROUTER_DEPLOYMENT,
                                            ROUTER_IMPORT_PATH, deployment)

#: The events, in the order they take turns.
EVENTS = ("weights", "adapter_flip", "kill_variant_replica", "system_prompt", "tenant_limit",
          "kill_router_replica", "adapter_remove", "adapter_add", "kill_ledger")
KILLS = ("kill_variant_replica", "kill_router_replica", "kill_ledger")
#: A request started after a kill must be answered within this many seconds of the kill.
SERVICE_BACK_S = 10.0
#: The demo keys of serve_configs/tenants.yaml the loops use.
KEYS = {"ops": "sk-mesh-ops-demo", "acme": "sk-acme-demo", "globex": "sk-globex-demo"}
#: The loops: (name, tenant, model, stream).
LOOPS = (("base-stream", "ops", "smollm", True),
         ("base", "ops", "smollm", False),
         ("acme-stream", "acme", "smollm:acme-support", True),
         ("globex", "globex", "smollm:globex-report", False))
STABLE, CANARY = "smollm-v1", "smollm-v2"
#: The ledger actor's class (serve_app.tenancy.ledger.SharedTenantCounts).
LEDGER_CLASS = "SharedTenantCounts"


@dataclass
class Outcome:
    """One request of a loop. Times are ``time.monotonic()`` s."""

    loop: str
    stream: bool
    started: float
    ended: float = 0.0
    status: int = 0
    ok: bool = False
    error: str = ""
    variant: str = ""
    replica: str = ""


@dataclass
class Event:
    """One event: its kind, when it happened, and for a kill what was killed."""

    kind: str
    at: float
    detail: str = ""
    replica: str = ""  # a killed variant replica's id (its requests' x-mesh-replica)
    error: str = ""  # the event itself could not be done (a deploy refused, nothing to kill)


@dataclass
class Window:
    """What one event's window saw, and whether the promise for its kind held."""

    event: Event
    answered: int = 0
    failed: list[Outcome] = field(default_factory=list)
    in_flight: list[Outcome] = field(default_factory=list)  # at a kill
    allowed: int = 0  # failures the promise allows
    service_back_s: float | None = None  # a kill: to the first answer started after it
    problems: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return not self.problems

    def line(self) -> str:
        back = "" if self.service_back_s is None else f", service back in {self.service_back_s:.1f} s"
        kind = f"{self.event.kind}({self.event.detail})" if self.event.detail else self.event.kind
        return (f"{kind:<44} {self.answered:>5} answered {len(self.failed):>3} failed "
                f"(in flight at the event {len(self.in_flight)}, allowed {self.allowed}){back}"
                + ("" if self.held else "  NOT HELD: " + "; ".join(self.problems)))


# -- the config the drill changes -------------------------------------------------------------

def chaos_config(tenants_cfg: dict[str, Any], routers: int = 2) -> dict[str, Any]:
    """``serve_configs/tenants.yaml`` (already on the engine of choice) as a canary at 90/10:
    smollm-v2 a copy of smollm-v1, both serving acme's and globex's adapters, and ``routers``
    router replicas (a router replica's death then leaves one serving)."""
    cfg = copy.deepcopy(tenants_cfg)
    apps = cfg["applications"]
    router = next(a for a in apps if a.get("import_path") == ROUTER_IMPORT_PATH)
    deployment(router, ROUTER_DEPLOYMENT)["num_replicas"] = routers
    stable = next(a for a in apps if a["name"] == STABLE)
    apps.append({**copy.deepcopy(stable), "name": CANARY})
    route = _router_config(cfg)["routes"]["smollm"]
    route["variants"] = [{"application": STABLE, "weight": 90},
                         {"application": CANARY, "weight": 10}]
    return cfg


def _router_config(cfg: dict[str, Any]) -> dict[str, Any]:
    router = next(a for a in cfg["applications"] if a.get("import_path") == ROUTER_IMPORT_PATH)
    return deployment(router, ROUTER_DEPLOYMENT)["user_config"]


def _replica_config(cfg: dict[str, Any], app: str) -> dict[str, Any]:
    return deployment(next(a for a in cfg["applications"] if a["name"] == app),
                      REPLICA_DEPLOYMENT)["user_config"]


def change(cfg: dict[str, Any], kind: str) -> tuple[dict[str, Any], str]:
    """``cfg`` with the change ``kind`` applied (or undone, whichever it is not now), and a
    few words of what it did."""
    cfg = copy.deepcopy(cfg)
    if kind == "weights":
        variants = _router_config(cfg)["routes"]["smollm"]["variants"]
        canary = 20 if variants[1]["weight"] == 10 else 10
        variants[0]["weight"], variants[1]["weight"] = 100 - canary, canary
        return cfg, f"{100 - canary}/{canary}"
    if kind == "adapter_flip":
        for app in (STABLE, CANARY):
            for a in _replica_config(cfg, app)["adapters"]:
                if a["name"] == "acme-support":
                    a["version"] = 2 if a["version"] == 1 else 1
                    version = a["version"]
        return cfg, f"acme-support v{version}"
    if kind == "system_prompt":
        uc = _replica_config(cfg, CANARY)
        if uc.pop("system_prompt", None) is None:
            uc["system_prompt"] = "Answer in one short sentence."
        return cfg, "set" if "system_prompt" in uc else "removed"
    if kind == "tenant_limit":
        acme = next(t for t in _router_config(cfg)["tenants"] if t["id"] == "acme")
        acme["max_concurrent_requests"] = 8 if acme.get("max_concurrent_requests") == 16 else 16
        return cfg, f"acme max_concurrent_requests {acme['max_concurrent_requests']}"
    uc = _replica_config(cfg, CANARY)
    if kind == "adapter_remove":
        uc["adapters"] = [a for a in uc["adapters"] if a["name"] != "globex-report"]
        return cfg, f"globex-report off {CANARY}"
    if kind == "adapter_add":
        if not any(a["name"] == "globex-report" for a in uc["adapters"]):
            uc["adapters"].append({"name": "globex-report", "version": 1})
        return cfg, f"globex-report on {CANARY}"
    raise ValueError(f"not a change: {kind!r} (one of {', '.join(EVENTS)})")


# -- kills --------------------------------------------------------------------------------------

def _alive(class_name: str) -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
            if a.class_name == class_name and a.pid]


def kill(kind: str, turn: int) -> tuple[str, str]:
    """SIGKILL the process the kill ``kind`` names (``turn``: which variant's replica, in
    turn). Returns (what was killed, the killed variant replica's id or "").

    Raises:
        RuntimeError: no such process is alive on this host.
    """
    if kind == "kill_variant_replica":
        app = (STABLE, CANARY)[turn % 2]
        actors = _alive(f"ServeReplica:{app}:{REPLICA_DEPLOYMENT}")
    elif kind == "kill_router_replica":
        app, actors = "mesh", _alive(f"ServeReplica:mesh:{ROUTER_DEPLOYMENT}")
    elif kind == "kill_ledger":
        app, actors = "ledger", _alive(LEDGER_CLASS)
    else:
        raise ValueError(f"not a kill: {kind!r}")
    if not actors:
        raise RuntimeError(f"{kind}: no live process of {app} to kill")
    victim = actors[0]
    os.kill(victim.pid, signal.SIGKILL)
    replica = (victim.name or "").rsplit("#", 1)[-1] if kind == "kill_variant_replica" else ""
    return f"{app} pid {victim.pid}", replica


# -- the load -------------------------------------------------------------------------------------

async def _one(http: httpx.AsyncClient, loop: str, tenant: str, model: str, stream: bool,
               max_tokens: int) -> Outcome:
    out = Outcome(loop, stream, time.monotonic())
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "user": f"chaos-{loop}",
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers=headers) as r:
            out.status = r.status_code
            out.variant = r.headers.get("x-mesh-variant", "")
            out.replica = r.headers.get("x-mesh-replica", "")
            text = (await r.aread()).decode(errors="replace")
        if out.status != 200:
            out.error = text[:300]
        elif stream:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            errors = [e for e in events if e.startswith('{"error"')]
            out.ok = bool(events) and events[-1] == "[DONE]" and not errors
            out.error = errors[0][:300] if errors else ("" if out.ok else "no [DONE]")
        else:
            out.ok = bool(json.loads(text).get("choices"))
    except Exception as e:  # noqa: BLE001 -- a dropped connection is an outcome too
        out.error = f"{type(e).__name__}: {e}"[:300]
    out.ended = time.monotonic()
    return out


async def _loop(base_url: str, spec: tuple[str, str, str, bool], stop: asyncio.Event,
                outcomes: list[Outcome], max_tokens: int, timeout_s: float) -> None:
    loop, tenant, model, stream = spec
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as http:
        while not stop.is_set():
            outcomes.append(await _one(http, loop, tenant, model, stream, max_tokens))
            await asyncio.sleep(0.05)


# -- the drill ------------------------------------------------------------------------------------

async def chaos_drill(base_url: str, cfg: dict[str, Any],
                      deploy: Callable[[dict[str, Any]], None], *, period_s: float,
                      events: int = len(EVENTS), max_tokens: int = 16,
                      timeout_s: float = 120.0, settle_s: float | None = None,
                      log: Callable[[str], None] = print) -> list[Window]:
    """Run the drill against the mesh at ``base_url`` (``http://host:port``), whose config
    is ``cfg`` (:func:`chaos_config`, deployed already).

    Args:
        deploy: applies a whole Serve config and waits until it runs (``serve deploy``);
            called from a worker thread.
        period_s: seconds between two events.
        events: how many events, :data:`EVENTS` in turn (wrapping around).
        settle_s: the load runs this long after the last event (default ``period_s``).

    Returns:
        One :class:`Window` per event (:func:`verdicts` has judged each).
    """
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    loops = [asyncio.create_task(_loop(base_url, spec, stop, outcomes, max_tokens, timeout_s))
             for spec in LOOPS]
    done: list[Event] = []
    try:
        await asyncio.sleep(min(period_s, 5.0))  # the loops under way before the first event
        for i in range(events):
            kind = EVENTS[i % len(EVENTS)]
            event = Event(kind, time.monotonic())
            try:
                if kind in KILLS:
                    event.detail, event.replica = await asyncio.to_thread(
                        kill, kind, i // len(EVENTS))
                    event.at = time.monotonic()
                else:
                    cfg, event.detail = change(cfg, kind)
                    await asyncio.to_thread(deploy, cfg)
            except Exception as e:  # noqa: BLE001 -- recorded: the window then fails
                event.error = f"{type(e).__name__}: {e}"[:300]
            done.append(event)
            log(f"[chaos] {kind}: {event.detail or event.error} "
                f"({len(outcomes)} requests so far)")
            await asyncio.sleep(max(0.0, event.at + period_s - time.monotonic()))
        await asyncio.sleep(period_s if settle_s is None else settle_s)
    finally:
        stop.set()
        await asyncio.gather(*loops, return_exceptions=True)
    return verdicts(done, outcomes)


def verdicts(events: list[Event], outcomes: list[Outcome]) -> list[Window]:
    """Each event's window and the promise of its kind (the module docstring), judged. A
    request is answered in the window it started in; a failure belongs to the last event
    before it ended (a stream cut by a kill started before it). A failure before the first
    event fails the first window."""
    windows = [Window(e) for e in events]
    for i, w in enumerate(windows):
        end = events[i + 1].at if i + 1 < len(events) else float("inf")
        w.answered = sum(o.ok for o in outcomes if w.event.at <= o.started < end)
        w.in_flight = [o for o in outcomes
                       if o.started < w.event.at < (o.ended or float("inf"))]
    for o in outcomes:
        if not o.ok and windows:
            at = max((i for i, e in enumerate(events) if e.at <= (o.ended or float("inf"))),
                     default=0)
            windows[at].failed.append(o)
    for w in windows:
        event = w.event
        if event.error:
            w.problems.append(f"the event failed: {event.error}")
        if event.kind == "kill_variant_replica":
            allowed = [o for o in w.in_flight if o.stream and o.replica == event.replica]
        elif event.kind == "kill_router_replica":
            allowed = w.in_flight
        else:
            allowed = []
        w.allowed = len(allowed)
        if stray := [o for o in w.failed if o not in allowed]:
            w.problems.append(f"{len(stray)} failed beyond what the promise allows: "
                              f"{_brief(stray)}")
        if event.kind in KILLS:
            first = min((o.ended for o in outcomes if o.ok and o.started >= event.at),
                        default=None)
            w.service_back_s = None if first is None else first - event.at
            if first is None or first - event.at > SERVICE_BACK_S:
                w.problems.append(f"no request started after the kill was answered within "
                                  f"{SERVICE_BACK_S:g} s")
    return windows


def _brief(failed: list[Outcome]) -> str:
    return ", ".join(f"{o.loop} {o.status} {o.error[:80]!r}" for o in failed[:4])


def summary(windows: list[Window]) -> list[str]:
    """The drill's table, a line per window, then the totals."""
    lines = [w.line() for w in windows]
    changes = [w for w in windows if w.event.kind not in KILLS]
    kills = [w for w in windows if w.event.kind in KILLS]
    lines.append(f"changes: {len(changes)} windows, {sum(len(w.failed) for w in changes)} "
                 f"failed; kills: {len(kills)}, {sum(len(w.failed) for w in kills)} failed "
                 f"(allowed {sum(w.allowed for w in kills)}); "
                 f"{'every promise held' if all(w.held for w in windows) else 'NOT HELD'}")
    return lines


def run(a) -> None:
    """``scripts/bench.py --chaos``: start a local Ray cluster, deploy
    ``serve_configs/tenants.yaml`` as :func:`chaos_config` on ``a.engine``, run
    :func:`chaos_drill` for ``a.minutes`` (an event every ``a.period`` s), print each
    window, write ``--json``, and exit 1 when a promise did not hold."""
    import tempfile
    from pathlib import Path

    import ray
    import yaml

    from bench.router_throughput import wait_for_ingress
    from bench.servers import start_local_ray
    from serve_app.common.paths import REPO_ROOT
    from serve_app.common.serve_configs import load_yaml, on_sim_engine
    from serve_app.common.serve_env import serve_env
    from serve_app.release.deploy import deploy

    period = a.period or (12.0 if a.engine == "sim" else 75.0)
    dashboard, http_port, _ = start_local_ray(serve_env())
    workdir = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    n = 0

    def apply(cfg: dict[str, Any]) -> None:
        nonlocal n
        n += 1
        path = workdir / f"chaos-{n}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        deploy(path, dashboard, log=lambda m: None)

    try:
        tenants = load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml")
        if a.engine == "sim":
            tenants = on_sim_engine(tenants, start_s=0)
        cfg = chaos_config(tenants)
        cfg["http_options"] = {"host": "127.0.0.1", "port": http_port}
        print(f"[chaos] deploying a 90/10 canary with two router replicas on the {a.engine} "
              f"engine; then {a.minutes:g} minutes, an event every {period:g} s", flush=True)
        apply(cfg)
        wait_for_ingress(f"http://127.0.0.1:{http_port}")
        events = max(1, int(a.minutes * 60 // period))
        windows = asyncio.run(chaos_drill(f"http://127.0.0.1:{http_port}", cfg, apply,
                                          period_s=period, events=events))
    finally:
        ray.shutdown()
    for line in summary(windows):
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps([{
            "event": w.event.kind, "detail": w.event.detail, "answered": w.answered,
            "failed": len(w.failed), "in_flight": len(w.in_flight), "allowed": w.allowed,
            "service_back_s": w.service_back_s, "problems": w.problems} for w in windows],
            indent=1))
    if not all(w.held for w in windows):
        raise SystemExit(1)
