"""Hooks of the whole suite: the integration modules in the order that restarts the fewest
engines (unit tests first), the ``slow`` integration tests left to ``./scripts/test.sh --all``,
and the time each module took against the default tier's budget. The integration fixtures are
in ``tests/integration/conftest.py``; helpers both tiers share in ``tests/support/``.
"""

from __future__ import annotations

import os
import time

from tests.support.mesh import DEPLOY_SECONDS, RESTARTS, TEST_ENGINE


#: Integration modules in the order that restarts the fewest engines: each deploys its own
#: config onto the shared cluster, and a variant whose code version (args, runtime_env,
#: request_router_config, autoscaling policy) stays the same keeps its replica. Each deploy
#: that replaced replicas is listed at the end of the run. No module restores a config when
#: it ends: the next one deploys its own.
MODULE_ORDER = ["test_replica_routing",  # first: the router's handle is made with its config
                "test_ingress", "test_tenants", "test_tenant_token_budgets", "test_fairness",
                "test_overload",
                "test_in_place", "test_canary", "test_rollouts", "test_traffic_safety",
                "test_shadow_traffic",
                "test_observability",  # some panels read the counts of the modules before
                "test_scale_to_zero",  # changes smollm-v2's autoscaling (a restart)
                "test_base_swap",  # changes smollm-v1's args and swaps its base model
                "test_model_sources",  # adds two variants whose weights are in a bucket
                "test_chaos",  # kills a variant replica, a router replica and the ledger
                "test_real_engine",  # real vLLM engines: after every module on the sim
                "test_multi_node"]  # last: it kills a node


#: Run the integration tests marked ``slow`` in this tier too (``--all`` always does).
RUN_SLOW = TEST_ENGINE == "vllm" or os.environ.get("MESH_TEST_SLOW") == "1"
_left_to_all: list[str] = []


def pytest_collection_modifyitems(config, items):
    if not RUN_SLOW:  # the default tier leaves them to --all (named in the summary)
        slow = [i for i in items if i.get_closest_marker("slow")]
        _left_to_all.extend(i.nodeid for i in slow)
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [i for i in items if not i.get_closest_marker("slow")]

    def rank(item) -> int:
        package, _, name = item.module.__name__.rpartition(".")
        if package != "tests.integration" or name not in MODULE_ORDER:
            return 0  # unit tests first, whatever their name (tests/unit/bench/test_chaos.py)
        return MODULE_ORDER.index(name) + 1
    items.sort(key=rank)  # stable: the order within a module is kept


# -- per-module durations, and the time budget of the default tier ------------------------------

#: The default tier's goal: 25 minutes, set-up included (issue 26). Not met on 2-core hosts
#: yet (the same tests took 1,191-2,382 s, host to host and day to day): the summary says
#: by how much on every run.
TEST_GOAL_S = 1500
#: Seconds past which the run fails (``MESH_TEST_BUDGET_S``; 0: none): 60 minutes, two
#: thirds of CI's hard limit, so a regression fails here before CI cuts the run off, and
#: above the slowest host measured (2,382 s in CI), so a slow day is not a failure.
TEST_BUDGET_S = float(os.environ.get("MESH_TEST_BUDGET_S", "3600"))
_module_seconds: dict[str, float] = {}
#: When the tier started: ``MESH_TEST_STARTED_AT`` (epoch s, set by scripts/test.sh before
#: its set-up and its two pytest runs), else this run's start.
_session_start = time.monotonic() - (
    time.time() - float(os.environ["MESH_TEST_STARTED_AT"])
    if os.environ.get("MESH_TEST_STARTED_AT") else 0.0)


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    total = time.monotonic() - _session_start
    tr = terminalreporter
    tr.section("time per test module (setup + call + teardown), s")
    for module, seconds in sorted(_module_seconds.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{seconds:8.1f}  {module}")
    tr.write_line(f"{total:8.1f}  total (engine for integration tests: {TEST_ENGINE}; "
                  f"goal {TEST_GOAL_S} s; fails past {TEST_BUDGET_S:.0f} s)")
    if _left_to_all:
        tr.section(f"integration tests left to ./scripts/test.sh --all (slow): "
                   f"{len(_left_to_all)}")
        for nodeid in _left_to_all:
            tr.write_line(nodeid)
    if DEPLOY_SECONDS:
        tr.write_line(f"{sum(DEPLOY_SECONDS):8.1f}  of it in {len(DEPLOY_SECONDS)} deploys "
                      f"(serve deploy until RUNNING; median "
                      f"{sorted(DEPLOY_SECONDS)[len(DEPLOY_SECONDS) // 2]:.1f} s)")
    if RESTARTS:
        tr.section(f"deploys that replaced replicas: {len(RESTARTS)}")
        for line in RESTARTS:
            tr.write_line(line)
    if TEST_GOAL_S < total <= (TEST_BUDGET_S or float("inf")) and not RUN_SLOW:
        tr.write_line(f"over the goal: the tests took {total:.0f} s, {total - TEST_GOAL_S:.0f} s "
                      f"more than the {TEST_GOAL_S} s goal", yellow=True, bold=True)
    if TEST_BUDGET_S and total > TEST_BUDGET_S:
        tr.write_line(f"FAILED: the tests took {total:.0f} s, over the budget of "
                      f"{TEST_BUDGET_S:.0f} s (MESH_TEST_BUDGET_S)", red=True, bold=True)


def pytest_sessionfinish(session, exitstatus):
    if TEST_BUDGET_S and time.monotonic() - _session_start > TEST_BUDGET_S and exitstatus == 0:
        session.exitstatus = 1

