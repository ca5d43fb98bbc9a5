"""Unit tests of ``bench.py --router-throughput``'s pure parts: which process plays which role
(bench/mesh_processes.py), the idle subtraction, py-spy's samples summed by thread, library
and function (bench/pyspy.py), the side-by-side table and the goals (bench/router_throughput.py),
and the ingress settings (serve_app/common/serve_env.py)."""

from __future__ import annotations

import pytest

from bench import pyspy
from bench.mesh_processes import MESH_ROLES, CpuSpent, actor_role, is_ray_daemon, per_request_ms
from bench.router_throughput import goal_lines, ingresses, run_figures, table
from serve_app.common.serve_env import DEFAULT_INGRESS, INGRESS_VAR, serve_env


@pytest.mark.parametrize("class_name, role", [
    ("ServeReplica:mesh:MeshRouter", "router"),
    ("ServeReplica:mesh:RolloutController", "rollout"),
    ("ServeReplica:smollm-v1:LLMReplica", "replica"),
    ("ServeReplica:mesh:SomethingNew", "other"),  # a deployment the mesh adds later counts
    ("ProxyActor", "proxy"),
    ("HAProxyManager", "haproxy"),
    ("ServeController", "controller"),
    ("SharedTenantCounts", "ledger"),
    ("TenantLedger", "ledger"),
    ("JobSupervisor", None),
    ("", None),
])
def test_actor_roles(class_name, role):
    assert actor_role(class_name) == role


def test_the_mesh_roles_leave_out_the_variant_replica_and_rays_daemons():
    assert "replica" not in MESH_ROLES and "ray" not in MESH_ROLES
    assert {"proxy", "haproxy", "router", "ledger", "controller", "rollout"} <= set(MESH_ROLES)


@pytest.mark.parametrize("cmdline, daemon", [
    (["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--x"], True),
    (["/venv/.../ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp"], True),
    (["ray::DashboardAgent"], True),
    (["ray-dashboard-ServeHead-0 (/venv/bin/python -B -c ...)"], True),
    (["/venv/bin/python", "/venv/lib/python3.11/site-packages/ray/dashboard/dashboard.py"], True),
    (["/venv/bin/python", "-u", "/venv/.../ray/_private/log_monitor.py", "--x"], True),
    (["ray::ServeReplica:mesh:MeshRouter"], False),
    (["/venv/bin/python", "-m", "pytest"], False),
    ([], False),
])
def test_ray_daemons_by_command_line(cmdline, daemon):
    assert is_ray_daemon(cmdline) is daemon


def test_cpu_per_request_subtracts_the_idle_rate_over_the_loads_wall_time():
    idle = CpuSpent({"router": 1.0, "proxy": 0.0}, wall_s=10.0)  # 0.1 s of CPU per second idle
    load = CpuSpent({"router": 3.0}, 5.0) + CpuSpent({"router": 2.0, "proxy": 1.0}, 5.0)
    assert load.wall_s == 10.0 and load.seconds == {"router": 5.0, "proxy": 1.0}
    # router: (5.0 - 0.1 * 10) / 200 requests = 20 ms; proxy: 1.0 / 200 = 5 ms
    assert per_request_ms(load, idle, 200) == pytest.approx({"router": 20.0, "proxy": 5.0})
    # never below zero (a process that idled harder than it worked)
    assert per_request_ms(CpuSpent({"router": 0.5}, 10.0), idle, 10) == {"router": 0.0}


RAW = """\
thread (101): MainThread;run (/v/asyncio/base_events.py:1);_run (/v/asyncio/events.py:2);\
_serve (/w/serve_app/router.py:10);_drain (/w/serve_app/tenancy/call_batcher.py:5);\
_actor_method_call (/v/site-packages/ray/actor.py:9) 30
thread (101): MainThread;run (/v/asyncio/base_events.py:1);_run (/v/asyncio/events.py:2);\
_serve (/w/serve_app/router.py:10);_record (/v/site-packages/ray/util/metrics.py:3) 10
thread (102): ThreadPoolExecutor-0_1;_bootstrap (/v/threading.py:1);run (/v/threading.py:9) 40
thread (103): ThreadPoolExecutor-0_2;_bootstrap (/v/threading.py:1);run (/v/threading.py:9) 20
not a sample line
"""


def test_pyspy_samples_by_thread_library_and_function():
    stacks = pyspy.parse_collapsed(RAW)
    assert sum(stacks.values()) == 100
    p = pyspy.summarize(stacks)
    assert p.samples == 100
    assert dict(p.by_thread) == {"ThreadPoolExecutor-0": 0.6, "MainThread": 0.4}
    areas = dict(p.by_area)
    assert areas["Ray core (actor calls, serialization)"] == 0.3
    assert areas["Ray metrics"] == 0.1
    assert areas[pyspy.PLUMBING[1]] == 0.6  # native code under Thread.run
    assert p.by_self[0] == ("run (threading.py)", 0.6)
    total = dict(p.by_total)
    assert total["_serve (router.py)"] == 0.4 and total["_drain (call_batcher.py)"] == 0.3
    # plumbing (event loop, thread bootstrap) says nothing about what the time is for
    assert not any("base_events" in name or "threading" in name for name in total)
    assert pyspy.Profile.from_json(p.as_json()) == p
    assert any("ThreadPoolExecutor-0" in line for line in p.lines())


def test_pyspy_frames_and_threads():
    assert pyspy.frame_name("fetch (/a/b/http_util.py:12)") == "fetch (http_util.py)"
    assert pyspy.thread_name("thread (0x7f12): ray_import_thread") == "ray_import_thread"
    assert pyspy.thread_name("thread (7)") == "unnamed"
    assert pyspy.thread_name("_serve (router.py:3)") is None
    assert pyspy.area("x (/w/serve_app/dispatch/relay.py:1)") == "the mesh (serve_app)"
    assert pyspy.area("x (/v/grpc/aio/_call.py:1)") == "gRPC"
    assert pyspy.summarize(pyspy.parse_collapsed("")).lines()[0].startswith("  no samples")


def _run(ingress: str, proxy_ms: float, router_ms: float) -> dict:
    cpu = {"proxy": proxy_ms, "router": router_ms, "ledger": 1.0, "controller": 0.0,
           "replica": 6.0, "ray": 0.5}
    mesh = {"requests_per_s": 50.0, "errors": 0, "cpu_ms": cpu}
    direct = {"requests_per_s": 100.0, "errors": 0, "cpu_ms": {"direct": 3.0}}
    return run_figures(ingress, mesh, direct, {"ttft_p50_ms": 18.0, "errors": 0},
                       {"ttft_p50_ms": 7.0, "errors": 0}, {"router": 1}, {})


def test_run_figures_sum_the_mesh_roles_and_make_the_ratios():
    r = _run("proxy", 5.0, 7.0)
    assert r["mesh_cpu_ms"] == 13.0  # proxy + router + ledger + controller, not replica/ray
    assert r["mesh_over_replica"] == pytest.approx(13.0 / 6.0)
    assert r["mesh_over_direct"] == 0.5 and r["ttft_overhead_ms"] == 11.0
    assert r["direct_cpu_ms"] == 3.0
    # the ratios the goals are about: each process's CPU against vLLM's own server's
    assert r["mesh_cpu_over_direct"] == pytest.approx(13.0 / 3.0)
    assert r["replica_over_direct"] == pytest.approx(6.0 / 3.0)


def test_table_puts_the_ingresses_side_by_side():
    lines = table([_run("proxy", 5.0, 7.0), _run("haproxy", 0.0, 4.0)])
    assert lines[0] == "| figure | ingress: proxy | ingress: haproxy |"
    text = "\n".join(lines)
    assert "| 50.0 / 100.0 (**0.50**) | 50.0 / 100.0 (**0.50**) |" in text
    assert "(**+11.0**)" in text
    assert "| **13.0** | **5.0** |" in text  # the mesh's own sums
    assert "HAProxy" not in text  # a role no run had gets no row
    assert all(line.count("|") == 4 for line in lines)
    assert "not in the sum" in lines[-1]


def test_goal_lines_say_met_or_not():
    lines = goal_lines(_run("haproxy", 0.0, 1.0))  # 2.0 ms of mesh CPU against 3.0 direct
    assert lines[0].strip().startswith("met") and "0.67 (2.0 / 3.0 ms)" in lines[0]
    assert lines[1].strip().startswith("NOT met") and "2.00 (6.0 / 3.0 ms)" in lines[1]
    assert lines[2].strip().startswith("NOT met")  # 0.5 of vLLM's requests/s
    assert lines[3].strip().startswith("NOT met")  # +11 ms of TTFT
    assert len(lines) == 4


def test_ingresses_to_measure(monkeypatch):
    monkeypatch.delenv(INGRESS_VAR, raising=False)
    assert ingresses(None) == [DEFAULT_INGRESS]
    assert sorted(ingresses("both")) == ["haproxy", "proxy"]
    assert ingresses("both")[0] == DEFAULT_INGRESS
    monkeypatch.setenv(INGRESS_VAR, "haproxy")
    assert ingresses(None) == ["haproxy"]
    with pytest.raises(ValueError, match="one of haproxy, proxy"):
        ingresses("nginx")


def test_serve_env_per_ingress(monkeypatch):
    monkeypatch.delenv(INGRESS_VAR, raising=False)
    proxy, haproxy = serve_env("proxy"), serve_env("haproxy")
    assert proxy["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert proxy["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    assert haproxy["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert haproxy["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"  # what HAProxy implies, said
    for env in (proxy, haproxy):
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert serve_env() == serve_env(DEFAULT_INGRESS)
    monkeypatch.setenv(INGRESS_VAR, "haproxy")
    assert serve_env() == haproxy
    monkeypatch.setenv(INGRESS_VAR, "nginx")
    with pytest.raises(ValueError, match="MESH_INGRESS='nginx'.*haproxy, proxy"):
        serve_env()


def test_the_load_tenant_is_budgeted_without_a_concurrency_limit_and_leases_follow_the_flag():
    """A tenant with max_concurrent_requests is never leased, so the benchmark's tenant has
    none: its budgets are lifted, and the router's ``ledger.leases`` is what --leases says."""
    from bench.router_throughput import TENANT, lease_choices, lifted
    from serve_app.common.paths import REPO_ROOT
    from serve_app.common.serve_configs import load_yaml

    for leases in (True, False):
        cfg = lifted(load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml"), leases)
        router = cfg["applications"][0]["deployments"][0]["user_config"]
        tenant = next(t for t in router["tenants"] if t["id"] == TENANT)
        assert "max_concurrent_requests" not in tenant
        assert tenant["tokens_per_minute"] >= 10**9 and tenant["requests_per_minute"] >= 10**6
        assert router["ledger"]["leases"] is leases
    assert lease_choices("both") == [False, True] and lease_choices("on") == [True]
    cfg = lifted(load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml"), True, headroom=2.0)
    routes = cfg["applications"][0]["deployments"][0]["user_config"]["routes"]
    assert {r["admission"]["headroom"] for r in routes.values()} == {2.0}
