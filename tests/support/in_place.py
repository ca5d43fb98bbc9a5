"""Every kind of in-place change the mesh supports (docs/in-place-changes.md), applied one
after another with ``serve deploy`` while four client loops run (:func:`soak`): shared by the
soak on the simulated engine (``test_in_place.py``) and its short run on vLLM
(``test_real_engine.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

ACME = {"authorization": "Bearer sk-acme-demo"}
GLOBEX = {"authorization": "Bearer sk-globex-demo"}
OPS = {"authorization": "Bearer sk-mesh-ops-demo"}
QUESTION = [{"role": "user", "content": "What is the largest ocean on Earth?"}]


def router(cfg) -> dict:
    """The router's ``user_config`` in ``cfg``."""
    return cfg["applications"][0]["deployments"][0]["user_config"]


def variant(cfg, name: str = "smollm-v1") -> dict:
    """Variant application ``name`` of ``cfg``."""
    return next(a for a in cfg["applications"] if a["name"] == name)


def replica(cfg, name: str = "smollm-v1") -> dict:
    """The LLMReplica deployment of variant ``name``."""
    return variant(cfg, name)["deployments"][0]


# -- the changes: every in-place kind the mesh supports ---------------------------------------

def adapter_versions(versions: dict[str, int]) -> Callable[[dict], None]:
    """A change that declares exactly ``versions`` (adapter name -> version) on smollm-v1."""
    def change(cfg):
        replica(cfg)["user_config"]["adapters"] = [{"name": n, "version": v}
                                                   for n, v in versions.items()]
    return change


def set_field(path: Callable[[dict], dict], key: str, value) -> Callable[[dict], None]:
    """A change that sets ``key`` to ``value`` in the dict ``path(cfg)`` returns."""
    def change(cfg):
        path(cfg)[key] = value
    return change


def _weights(a: int, b: int) -> Callable[[dict], None]:
    def change(cfg):
        vs = router(cfg)["routes"]["smollm-b"]["variants"]
        vs[0]["weight"], vs[1]["weight"] = a, b
    return change


def _tenant_limit(n: int) -> Callable[[dict], None]:
    def change(cfg):
        next(t for t in router(cfg)["tenants"] if t["id"] == "acme")[
            "max_concurrent_requests"] = n
    return change


def _add_tenant(cfg):
    router(cfg)["tenants"].append({"id": "newco", "api_keys_sha256": ["ab" * 32]})


def _admission(timeout_s: float) -> Callable[[dict], None]:
    def change(cfg):
        router(cfg)["routes"]["smollm"].setdefault("admission", {})["queue_timeout_s"] = timeout_s
    return change


def _adapter_split(cfg):
    router(cfg)["routes"]["smollm"]["adapters"] = {"acme-support": {"versions": [
        {"version": 1, "weight": 50}, {"version": 2, "weight": 50}]}}


#: (kind, change), applied in this order, each on top of the last. The kinds are those of
#: docs/in-place-changes.md, where each is explained (test_docs checks the two agree).
CHANGES: list[tuple[str, Callable[[dict], None]]] = [
    ("adapter version", adapter_versions({"acme-support": 2, "globex-report": 1})),
    ("system prompt", set_field(lambda c: replica(c)["user_config"], "system_prompt",
                                "Be brief.")),
    ("max_adapters_per_replica", set_field(lambda c: replica(c)["user_config"],
                                           "max_adapters_per_replica", 1)),
    ("route weights", _weights(50, 50)),
    ("adapter removed", adapter_versions({"acme-support": 2})),
    ("adapter added", adapter_versions({"acme-support": 2, "globex-report": 1})),
    ("adapter version", adapter_versions({"acme-support": 1, "globex-report": 1})),
    ("tenant limits", _tenant_limit(12)),
    ("tenant added", _add_tenant),
    ("admission", _admission(20)),
    ("adapter version split", _adapter_split),
    ("stream_batching_interval_ms", set_field(lambda c: replica(c)["user_config"],
                                              "stream_batching_interval_ms", 50)),
    ("max_ongoing_requests", set_field(replica, "max_ongoing_requests", 48)),
    ("max_queued_requests", set_field(replica, "max_queued_requests", 48)),
    ("graceful_shutdown_timeout_s", set_field(replica, "graceful_shutdown_timeout_s", 240)),
    ("health_check_period_s", set_field(replica, "health_check_period_s", 3)),
    ("router deployment options", set_field(lambda c: c["applications"][0]["deployments"][0],
                                            "max_queued_requests", 900)),
    ("num_replicas", set_field(replica, "num_replicas", 2)),
    ("num_replicas", set_field(replica, "num_replicas", 1)),
    ("max_adapters_per_replica", set_field(lambda c: replica(c)["user_config"],
                                           "max_adapters_per_replica", 2)),
]


# -- the client loops ---------------------------------------------------------------------------

@dataclass
class Loop:
    """One client sending the same kind of request over and over until told to stop."""

    name: str
    body: dict
    headers: dict
    answers: int = 0
    failures: list[str] = field(default_factory=list)
    adapters: set[str] = field(default_factory=set)

    def run(self, base_url: str, stop: threading.Event) -> None:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            while not stop.is_set():
                try:
                    self._one(http)
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")

    def _one(self, http: httpx.Client) -> None:
        if not self.body.get("stream"):
            r = http.post("/v1/chat/completions", json=self.body, headers=self.headers)
            ok = r.status_code == 200
            detail = r.text[:300]
        else:
            with http.stream("POST", "/v1/chat/completions", json=self.body,
                             headers=self.headers) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            ok = (r.status_code == 200 and lines[-1:] == ["data: [DONE]"]
                  and not any('"error"' in line for line in lines))
            detail = next((line for line in lines if '"error"' in line), lines[-1:])
        if not ok:
            self.failures.append(f"{r.status_code} at {time.strftime('%X')}: {detail}")
            return
        self.answers += 1
        if "x-mesh-adapter" in r.headers:
            self.adapters.add(r.headers["x-mesh-adapter"])


def loops() -> list[Loop]:
    """The four loops: adapter and base model, streamed and not."""
    ask = {"messages": QUESTION, "max_tokens": 16, "ignore_eos": True}
    return [Loop("adapter stream", {"model": "smollm:acme-support", "stream": True, **ask}, ACME),
            Loop("adapter non-stream", {"model": "smollm:acme-support", **ask}, ACME),
            Loop("base stream", {"model": "smollm", "stream": True, **ask}, OPS),
            Loop("base non-stream", {"model": "smollm", **ask}, OPS)]


def adapter_contention_loops() -> list[Loop]:
    """Two adapters under steady load on one variant: three acme-support loops, streamed and
    not, of different lengths (batched together, they would all end in one engine step and
    leave the slot idle; these never end together, so acme's slot is never idle), one
    globex-report loop, and the base model streamed."""
    ask = {"messages": QUESTION, "ignore_eos": True}
    acme = {"model": "smollm:acme-support", **ask}
    return [Loop("acme stream", {**acme, "stream": True, "max_tokens": 41}, ACME),
            Loop("acme stream 2", {**acme, "stream": True, "max_tokens": 29}, ACME),
            Loop("acme non-stream", {**acme, "max_tokens": 19}, ACME),
            Loop("globex non-stream", {"model": "smollm:globex-report", "max_tokens": 16,
                                       **ask}, GLOBEX),
            Loop("base stream", {"model": "smollm", "stream": True, "max_tokens": 16, **ask},
                 OPS)]


def soak(mesh, cfg: dict, changes: list[tuple[str, Callable[[dict], None]]],
         answered_between: bool = False, clients: list[Loop] | None = None,
         answers_before: int = 1) -> list[Loop]:
    """Apply ``changes`` one after another with ``serve deploy`` (each waits for RUNNING, and
    fails if it replaced a replica: every change here is in place) while the client loops run (default: :func:`loops`); returns the loops (their answers
    and failures). Every loop is answered ``answers_before`` times before the first change.
    ``answered_between``: after each change, wait until every loop has had an answer since
    (a slow engine's loops would otherwise see several changes within one request)."""
    clients, stop = clients or loops(), threading.Event()
    threads = [threading.Thread(target=c.run, args=(mesh.base_url, stop)) for c in clients]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while not all(c.answers >= answers_before for c in clients):  # before any change
            assert time.monotonic() < deadline, [(c.name, c.answers, c.failures[:2])
                                                 for c in clients]
            time.sleep(0.2)
        for i, (kind, change) in enumerate(changes, 1):
            change(cfg)
            t0 = time.monotonic()
            mesh.deploy(cfg, in_place=True)  # an engine restart fails the soak
            print(f"  change {i:2}: {kind:<28} applied in {time.monotonic() - t0:4.1f} s; "
                  f"answers so far {sum(c.answers for c in clients)}", flush=True)
            if answered_between:
                before = [c.answers for c in clients]
                deadline = time.monotonic() + 120
                while any(c.answers <= n for c, n in zip(clients, before)):
                    assert time.monotonic() < deadline, [(c.name, c.failures[:2])
                                                         for c in clients]
                    time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    for c in clients:
        print(f"  {c.name:<20} {c.answers} answers, {len(c.failures)} failures "
              f"{sorted(c.adapters)}")
    return clients
