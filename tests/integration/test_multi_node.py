"""The mesh on two Ray nodes (run last: its final test kills a node).

A second Ray node joins the session's cluster from its own network namespace on this
machine (:mod:`netns_node`: its own loopback and address, so its Serve proxy does not
contend with the head's for 127.0.0.1:port under ``proxy_location: EveryNode``). It has no
CPUs and one custom resource, ``mesh_worker``, so only what asks for it lands there:
variant ``smollm-v2`` (and its node's proxy). The head runs ``smollm-v1``, two
``MeshRouter`` replicas and the ``RolloutController``.

Proven here: variants on different nodes; a tenant limit held across two routers; the
zero-drop canary ramp and adapter upgrade across nodes; and the loss of the worker node
under stream load (its streams end, counted as errors, new requests fail over, the head
keeps its state, and no vLLM engine process is left behind).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from serve_app.common.serve_env import chosen_ingress
from serve_app.request.split import pick_variant
from serve_app.release.deploy import running_replicas, serve_status
from bench.loadgen import LoadSpec, background_load, wait_for_results
from tests.support.metrics import metric_total
from tests.support.netns_node import NODE_IP, NamespacedNode
from tests.support.replicas import engine_processes, stream_and_kill
from tests.support.rollouts import SLOW, rollout_state, router_uc
from tests.support.tenants import ACME_V1, ACME_V2, KEYS, sig
from tests.support.waits import wait_for_metric

pytestmark = pytest.mark.integration

WORKER_RESOURCE = "mesh_worker"
OPS = {"authorization": f"Bearer {KEYS['ops']}"}


def configured(base, weights=(100, 0), adapters=(("acme-support", 1), ("globex-report", 1)),
               rollout: dict | None = None):
    """``base`` with route smollm split ``weights`` (v1, v2) and ``adapters`` on both."""
    cfg = copy.deepcopy(base)
    route = router_uc(cfg)["routes"]["smollm"]
    route["variants"] = [{"application": "smollm-v1", "weight": weights[0]},
                         {"application": "smollm-v2", "weight": weights[1]}]
    if rollout is not None:
        route["rollout"] = rollout
    for app in cfg["applications"][1:]:
        app["deployments"][0]["user_config"]["adapters"] = [
            {"name": n, "version": v} for n, v in adapters]
    return cfg


def two_node_config(tenants_yaml: dict) -> dict:
    """serve_configs/tenants.yaml with a proxy on every node, two router replicas, tenant
    initech limited to 2 requests in flight, and a second variant pinned to the worker
    node."""
    cfg = copy.deepcopy(tenants_yaml)
    cfg["proxy_location"] = "EveryNode"
    cfg["applications"][0]["deployments"][0]["num_replicas"] = 2
    for t in router_uc(cfg)["tenants"]:
        if t["id"] == "initech":
            t["max_concurrent_requests"] = 2
            t.pop("requests_per_minute", None)
    v2 = copy.deepcopy(cfg["applications"][1])
    v2["name"] = "smollm-v2"
    v2["deployments"][0]["ray_actor_options"] = {"num_cpus": 0,
                                                 "resources": {WORKER_RESOURCE: 1}}
    cfg["applications"].append(v2)
    return configured(cfg)


@pytest.fixture(scope="module")
def two_nodes(mesh):
    import ray

    node = NamespacedNode(f"mesh-{os.getpid()}", ray.get_runtime_context().gcs_address,
                          {WORKER_RESOURCE: 1}, env=dict(os.environ))
    try:
        node.start()  # in the try: a half-made namespace is removed too
        deadline = time.monotonic() + 60
        while not (mine := [n for n in ray.nodes()
                            if n["NodeManagerAddress"] == NODE_IP and n["Alive"]]):
            assert time.monotonic() < deadline, "the worker node did not join"
            time.sleep(0.5)
        node.node_id = mine[0]["NodeID"]
        mesh.worker_node = node
        mesh.two_node_cfg = two_node_config(mesh.config("tenants.yaml"))
        mesh.deploy(mesh.two_node_cfg)
        yield mesh
    finally:
        node.stop()


def ask_inside(node: NamespacedNode, port: int) -> tuple[int, str | None]:
    """A chat request to the Serve proxy of the worker node (on its own 127.0.0.1)."""
    script = ("import httpx, sys; r = httpx.post(f'http://127.0.0.1:{sys.argv[1]}/v1/chat/"
              "completions', timeout=60, headers={'authorization': 'Bearer sk-mesh-ops-demo'},"
              " json={'model': 'smollm', 'max_tokens': 4, 'messages': [{'role': 'user', "
              "'content': 'hi'}]}); print(r.status_code, r.headers.get('x-mesh-variant'))")
    out = subprocess.run(["ip", "netns", "exec", node.name, sys.executable, "-c", script,
                          str(port)], capture_output=True, text=True, timeout=120)
    status, variant = (out.stdout.split() + ["0", ""])[:2]
    return int(status), variant


def stream_statuses(mesh, tenant: str, n: int) -> list[tuple[int, str | None]]:
    """``n`` concurrent 48-token streams of ``tenant``: (status, Retry-After) of each."""
    body = {"model": "smollm", "max_tokens": 48, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Count to fifty."}]}
    start = threading.Barrier(n)

    def one(_):
        with mesh.http() as http:
            start.wait()
            with http.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {KEYS[tenant]}"}) as r:
                r.read()
                return r.status_code, r.headers.get("retry-after")
    with ThreadPoolExecutor(n) as pool:
        return sorted(pool.map(one, range(n)))


def test_variants_on_two_nodes_and_a_tenant_limit_across_two_routers(two_nodes):
    head_id = ray_head_node_id()
    [v2] = running_replicas(two_nodes.dashboard, "smollm-v2", "LLMReplica")
    [v1] = running_replicas(two_nodes.dashboard, "smollm-v1", "LLMReplica")
    routers = running_replicas(two_nodes.dashboard, "mesh", "MeshRouter")
    print(f"\nsmollm-v1 on {v1['node_id'][:8]}, smollm-v2 on {v2['node_id'][:8]}, "
          f"{len(routers)} routers on {sorted({r['node_id'][:8] for r in routers})}")
    assert v2["node_id"] == two_nodes.worker_node.node_id
    assert v1["node_id"] == head_id and len(routers) == 2
    assert all(r["node_id"] == head_id for r in routers)
    # A proxy on each node (EveryNode; Serve starts the worker's once a replica runs
    # there); the worker's answers on its own loopback.
    deadline = time.monotonic() + 120
    while True:
        proxies = serve_status(two_nodes.dashboard)["proxies"]
        healthy = {k for k, p in proxies.items() if p["status"] == "HEALTHY"}
        if healthy >= {head_id, two_nodes.worker_node.node_id}:
            break
        assert time.monotonic() < deadline, {k[:8]: p["status"] for k, p in proxies.items()}
        time.sleep(2)
    print(f"proxies: { {k[:8]: p['status'] for k, p in proxies.items()} }")
    if chosen_ingress() == "proxy":
        # Serve's proxy relays over Ray, so the worker's answers on its own loopback. Ray's
        # HAProxy (the default) forwards HTTP to the router replicas' own ports, which the
        # tests bind to the head's loopback (http_options.host 127.0.0.1; a fleet binds
        # 0.0.0.0): from the worker's namespace they cannot be reached, so under HAProxy the
        # worker's ingress is checked healthy above and served through below on the head's.
        assert ask_inside(two_nodes.worker_node, two_nodes.http_port)[0] == 200

    # initech may have 2 requests in flight, across both routers together.
    for _ in range(2):
        got = stream_statuses(two_nodes, "initech", 6)
        print(f"6 concurrent initech streams through 2 routers: {got}")
        assert [s for s, _ in got] == [200, 200, 429, 429, 429, 429]
        assert all(retry for s, retry in got if s == 429)
        time.sleep(1)  # the routers give the slots back without waiting
    # A tenant without limits is not held back.
    assert [s for s, _ in stream_statuses(two_nodes, "globex", 4)] == [200] * 4


def ray_head_node_id() -> str:
    import ray
    return next(n["NodeID"] for n in ray.nodes()
                if n["Alive"] and n["Resources"].get("node:__internal_head__"))


def test_zero_drop_canary_ramp_across_nodes(two_nodes):
    spec = LoadSpec(base_url=f"{two_nodes.base_url}/v1", model="smollm", concurrency=4,
                    max_tokens=24, api_key=KEYS["ops"], duration_s=600, user_prefix="ramp-")
    with background_load(spec) as results:
        wait_for_results(results, 4)
        for weights in ((50, 50), (0, 100), (50, 50)):
            two_nodes.deploy(configured(two_nodes.two_node_cfg, weights))
            wait_for_results(results, len(results) + 4)
        wait_for_results(results, 20)
    by_variant = {v: sum(r.variant == v for r in results) for v in ("smollm-v1", "smollm-v2")}
    failed = [r for r in results if not r.ok]
    print(f"\nramp across nodes: {len(results)} streams, {len(failed)} failed, {by_variant}")
    assert len(results) >= 20 and not failed, [(r.status, r.error) for r in failed[:5]]
    assert by_variant["smollm-v1"] > 0 and by_variant["smollm-v2"] > 0


def test_zero_drop_adapter_upgrade_on_the_worker_node(two_nodes):
    two_nodes.deploy(configured(two_nodes.two_node_cfg, (0, 100)))  # everything on the worker
    before = two_nodes.all_replica_ids()
    spec = LoadSpec(base_url=f"{two_nodes.base_url}/v1", model="smollm:acme-support",
                    concurrency=4, max_tokens=24, api_key=KEYS["acme"], duration_s=600,
                    prompt="What is the largest ocean on Earth?")
    with background_load(spec) as results:
        wait_for_results(results, 4)
        two_nodes.deploy(configured(two_nodes.two_node_cfg, (0, 100),
                                    adapters=(("acme-support", 2), ("globex-report", 1))))
        deployed_at = time.monotonic()
        wait_for_results(results, 4, started_after=deployed_at)
    failed = [r for r in results if not r.ok]
    after = [r for r in results if r.started_at > deployed_at]
    print(f"\nadapter upgrade on the worker node: {len(results)} streams, {len(failed)} "
          f"failed, {len(after)} after the deploy, variants {sorted({r.variant for r in results})}")
    assert len(results) >= 8 and not failed, [(r.status, r.error) for r in failed[:3]]
    assert {r.variant for r in results} == {"smollm-v2"}
    assert after and all(r.text.startswith(sig(two_nodes, ACME_V2)) for r in after), [r.text for r in after]
    assert any(r.text.startswith(sig(two_nodes, ACME_V1)) for r in results if r.started_at < deployed_at)
    assert two_nodes.all_replica_ids() == before


def test_losing_the_worker_node_under_load(two_nodes):
    """Kill every Ray process of the worker node with SIGKILL (what `ray stop --force` does
    on a node, or a crash of its Ray processes): streams on it end and count as errors, no
    request hangs, new requests fail over to smollm-v1 before their first byte, the head
    keeps its routers, rollout and limits, and the node's vLLM engine is not left running.

    A router that had no request on the node learns of the loss from its next request there,
    which waits for the head timeout (the route's queue_timeout_s, 30 s) before it fails
    over, or from Serve once Ray declares the node dead."""
    two_nodes.deploy(configured(two_nodes.two_node_cfg, rollout={"id": "node-loss", **SLOW}))
    [v2] = running_replicas(two_nodes.dashboard, "smollm-v2", "LLMReplica")
    engines = engine_processes(v2["pid"], two_nodes.engine)
    assert engines, "no engine process found for the smollm-v2 replica"
    engine_names = [(p.pid, p.name()) for p in engines]
    routers = two_nodes.replica_ids("mesh", "MeshRouter")
    failed_streams = metric_total(two_nodes, "ray_mesh_errors_total", variant="smollm-v2",
                                  kind="stream_failed")
    with two_nodes.http() as http:
        history = rollout_state(http)["history"]
    caller = next(f"node-{i}" for i in itertools.count()
                  if pick_variant([("smollm-v1", 50), ("smollm-v2", 50)], "smollm",
                                  f"node-{i}") == "smollm-v2")
    body = {"model": "smollm", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Tell a long story."}]}
    spec = LoadSpec(base_url=f"{two_nodes.base_url}/v1", model="smollm", concurrency=4,
                    max_tokens=24, api_key=KEYS["ops"], duration_s=600, user_prefix="loss-",
                    timeout_s=60)
    gone_at: list[float] = []
    engines_gone = threading.Thread(target=lambda: gone_at.append(
        (psutil.wait_procs(engines, timeout=60), time.monotonic())[1]))

    def lose_the_node() -> None:
        two_nodes.worker_node.force_stop()
        engines_gone.start()
    with background_load(spec) as results, httpx.Client(base_url=two_nodes.base_url,
                                                       timeout=60) as http:
        lines, killed_at = stream_and_kill(http, body, {**OPS, "x-session-id": caller},
                                           "smollm-v2", lose_the_node)
        ended_s = time.monotonic() - killed_at
        time.sleep(15)
        r = http.post("/v1/chat/completions", headers={**OPS, "x-session-id": caller}, json={
            "model": "smollm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    print(f"\nthe stream on the lost node ended {ended_s:.1f} s after the kill: {lines[-2:]}")
    assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][len("data: "):])
    assert ended_s < 30
    # Its caller now fails over to the surviving variant.
    assert r.status_code == 200 and r.headers["x-mesh-variant"] == "smollm-v1", r.text

    after_kill = [x for x in results if x.started_at > killed_at + 2]
    lost = [x for x in results if not x.ok]
    print(f"background load: {len(results)} streams, {len(lost)} failed (in flight on the "
          f"node: {[(x.variant, x.error) for x in lost]}), {len(after_kill)} started 2 s "
          f"after the kill: variants {sorted({x.variant for x in after_kill})}")
    # No request waits past the head timeout (the route's queue_timeout_s, 30 s) + its
    # failover: a router that had no stream on the node learns of the loss by such a wait.
    print(f"slowest request: {max(x.latency_s for x in results):.1f} s")
    assert all(x.latency_s < 40 for x in results), "a request hung"
    assert all(x.variant == "smollm-v2" and x.started_at < killed_at + 2 for x in lost)
    assert after_kill and all(x.ok and x.variant == "smollm-v1" for x in after_kill)
    wait_for_metric(two_nodes, "ray_mesh_errors_total", failed_streams + 1, variant="smollm-v2",
                    kind="stream_failed")

    # The head keeps its state: the same routers, the rollout (its controller saves it in
    # Ray's GCS, so it survives even a controller that was on the lost node), the limits.
    assert two_nodes.replica_ids("mesh", "MeshRouter") == routers
    with two_nodes.http() as http:
        state = rollout_state(http)
    print(f"rollout after the loss: {state['state']}, decisions "
          f"{[d['decision'] for d in state['history']]}")
    assert state["history"][:len(history)] == history
    assert [s for s, _ in stream_statuses(two_nodes, "initech", 3)] == [200, 200, 429]

    # No engine outlives its node: the engine reaper stops what the dead replica left.
    engines_gone.join()
    alive = [p for p in engines if p.is_running()]
    print(f"engine processes of the lost node: {engine_names}; the last one ended "
          f"{gone_at[0] - killed_at:.1f} s after the kill; left running after 60 s: "
          f"{[p.pid for p in alive]}")
    assert not alive
