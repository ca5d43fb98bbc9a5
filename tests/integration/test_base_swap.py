"""Base-model releases on the real stack, under load: a blue/green swap of route ``smollm``
from ``smollm2-135m-instruct`` to ``smollm2-135m-acme`` with ``meshctl swap`` (zero drops);
an in-place ``args`` change, which Serve applies by surge replacement (the new replica starts
beside the old one); and a bad ``args`` deployed with the plain ``serve deploy`` CLI, which
fails the deploy while the old replica keeps serving.

The module starts from ``serve_configs/local.yaml`` and each test from the config the one
before left deployed, in the order that starts the fewest engines (bad args: none; the args
change: one; the swap: one). The module leaves the swap's last config deployed; other modules
deploy their own configs.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import time

import pytest

from tests.support.engines import signature
from serve_app.release.deploy import serve_cli, serve_status
from serve_app.observability.stats import percentile
from bench.loadgen import LoadSpec, RequestResult, background_load, wait_for_results
from serve_app.common.paths import REPO_ROOT

pytestmark = pytest.mark.integration

BASELINE_S = 4  # load before the change, for the "before" figures (~12 streams)
AFTER_REQUESTS = 4  # requests started after the change, before the load stops


def meshctl(*args: str) -> subprocess.CompletedProcess:
    """Run the real CLI, echoing its output as it comes; stdout and stderr merged."""
    proc = subprocess.Popen([sys.executable, "-m", "serve_app.cli", *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        print(f"    | {line}", end="", flush=True)
        lines.append(line)
    return subprocess.CompletedProcess(proc.args, proc.wait(), "".join(lines), "")


def load(mesh) -> LoadSpec:
    # timeout_s: a request may wait in the router's queue while a replica restarts.
    return LoadSpec(base_url=f"{mesh.base_url}/v1", model="smollm", concurrency=4,
                    max_tokens=24, duration_s=1800, timeout_s=300)


def window(results: list[RequestResult], start: float, end: float) -> list[RequestResult]:
    """Requests that started in [start, end) (time.monotonic())."""
    return [r for r in results if start <= r.started_at < end]


def figures(label: str, rs: list[RequestResult]) -> dict:
    lat = [r.latency_s for r in rs]
    out = {"requests": len(rs), "failed": sum(not r.ok for r in rs),
           "p95_s": round(percentile(lat, 95), 2), "max_s": round(max(lat, default=0), 2)}
    print(f"  {label:<28} {out}")
    return out


def report(what: str, results: list[RequestResult], t_change: float, t_done: float,
           detail: str) -> list[RequestResult]:
    """Print counts and latency before / during / after a change; return the failed requests
    (each printed with its status and error)."""
    failed = [r for r in results if not r.ok]
    print(f"\n{what}: {len(results)} streams, {len(failed)} failed, {detail}, "
          f"took {t_done - t_change:.0f} s")
    figures("before (baseline)", window(results, min(r.started_at for r in results), t_change))
    figures(f"during the {what}", window(results, t_change, t_done))
    figures("after", window(results, t_done, float("inf")))
    for r in failed[:10]:
        print(f"  FAILED status={r.status} after {r.latency_s:.1f} s "
              f"(started {r.started_at - t_change:+.1f} s from the change): {r.error}")
    return failed


def by_variant(results: list[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.variant] = counts.get(r.variant, 0) + 1
    return counts


def ask(mesh, question: str):
    with mesh.http() as http:
        return http.post("/v1/chat/completions", json={
            "model": "smollm", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 24})


@pytest.fixture(scope="module")
def released(mesh):
    """The mesh with local.yaml deployed. ``mesh.current`` is the config the last test left
    deployed: each test starts from it rather than going back to local.yaml, which would
    restart an engine (minutes here) for nothing."""
    mesh.current = mesh.deploy_shipped("local.yaml")
    return mesh


def test_bad_args_with_plain_serve_deploy_keep_the_old_replica_serving(released):
    """`serve deploy` (the plain CLI, no meshctl) of max_model_len 1,000,000,000 under load:
    the application goes DEPLOY_FAILED with vLLM's message naming the field, the replica
    that served keeps serving (the same process), and no request fails. Deploying the good
    config again brings the application back to RUNNING.

    On vLLM, build_app checks the engine args with vLLM's own checks, so no replica is
    touched; on the simulated engine (no check at build) the new replica fails at its start
    with the same vLLM check, and surge replacement keeps the old one serving: the
    deployment's message carries vLLM's words."""
    from ray import serve

    mesh = released
    cfg = mesh.current
    bad = copy.deepcopy(cfg)
    bad["applications"][1]["args"]["engine_args"]["max_model_len"] = 1_000_000_000
    bad_path = mesh.write(bad)
    replica = serve.get_deployment_handle("LLMReplica", app_name="smollm-v1")
    pid_before = replica.stats.remote().result()["pid"]
    spec = LoadSpec(base_url=f"{mesh.base_url}/v1", model="smollm", concurrency=1,
                    max_tokens=8, duration_s=600, timeout_s=120)
    with background_load(spec) as results:
        wait_for_results(results, 3)
        t_deploy = time.monotonic()
        proc = subprocess.run([serve_cli(), "deploy", "-a", mesh.dashboard, str(bad_path)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        # Serve builds an application in a task it retries 3 times on an exception
        # (`build_serve_application`, max_retries=3): 4 builds, each importing vLLM and
        # checking the engine config, 35-50 s each on this host.
        deadline = time.monotonic() + 480
        while (app := serve_status(mesh.dashboard)["applications"]["smollm-v1"])[
                "status"] != "DEPLOY_FAILED":
            assert time.monotonic() < deadline, app["status"]
            time.sleep(1)
        t_failed = time.monotonic()
        # The old replica keeps serving after the failure.
        wait_for_results(results, 3, started_after=t_failed)
        wait_for_results(results, 10)
    # the application's message, and its deployments' (a replica's start error)
    message = " ".join([app["message"], *(d.get("message", "") for d in
                                          (app.get("deployments") or {}).values())])
    print(f"\nDEPLOY_FAILED after {t_failed - t_deploy:.0f} s: {message[-400:]}")
    failed = [r for r in results if not r.ok]
    print(f"load through the bad deploy: {len(results)} requests, {len(failed)} failed")
    assert "max_model_len" in message and "1000000000" in message
    assert len(results) >= 10 and not failed, [(r.status, r.error) for r in failed[:5]]
    # The same replica process served throughout (the failed build touched no replica; the
    # status lists no deployments after a failed build, so ask the replica itself).
    assert replica.stats.remote().result()["pid"] == pid_before
    mesh.deploy(cfg)
    assert serve_status(mesh.dashboard)["applications"]["smollm-v1"]["status"] == "RUNNING"


def test_in_place_args_change_replaces_the_replica_by_surge_under_load(released):
    """Changing a variant's args in place (max_num_seqs 8 -> 6) makes Serve replace its only
    replica. `meshctl diff` says so beforehand. With `max_surge_percent: 100` the new replica
    starts beside the old one, which serves until the new one is up: under 4 concurrent
    streams no request fails and the p95 during the change stays within 3x before (the new
    engine's start shares this host's 2 CPUs with the old one: x1.8-2.1 measured; before
    max_surge_percent the change stalled every stream, x15)."""
    mesh = released
    cfg = mesh.current
    changed = copy.deepcopy(cfg)
    changed["applications"][1]["args"]["engine_args"]["max_num_seqs"] = 6
    old_path, new_path = mesh.write(cfg), mesh.write(changed)

    diff = meshctl("diff", str(old_path), str(new_path), "--fail-on-restart")
    assert diff.returncode == 1
    assert ("  smollm-v1: args.engine_args.max_num_seqs 8 -> 6: RESTART (application args "
            "change replaces every replica)\n") in diff.stdout

    before_ids = mesh.replica_ids("smollm-v1", "LLMReplica")
    with background_load(load(mesh)) as results:
        time.sleep(BASELINE_S)
        t_change = time.monotonic()
        # an args change is no in-place change: deployed as one, the in-place check (which
        # every in-place deploy of the suite uses) fails it, whatever the clients saw
        with pytest.raises(AssertionError, match="an in-place change .* replaced replicas"):
            mesh.deploy(changed, in_place=True)
        mesh.current = changed
        t_done = time.monotonic()
        wait_for_results(results, AFTER_REQUESTS, started_after=t_done)
    after_ids = mesh.replica_ids("smollm-v1", "LLMReplica")

    failed = report("surge replacement", results, t_change, t_done,
                    f"replica {sorted(before_ids)} -> {sorted(after_ids)}")
    assert after_ids and after_ids.isdisjoint(before_ids), "Serve did not replace the replica"
    assert not failed, [(r.status, r.error) for r in failed[:5]]
    before = [r.latency_s for r in window(results, 0, t_change)]
    during = [r.latency_s for r in window(results, t_change, t_done)]
    print(f"p95 before {percentile(before, 95):.2f} s, during {percentile(during, 95):.2f} s")
    assert percentile(during, 95) <= 3 * percentile(before, 95), (before, during)


@pytest.mark.slow  # the same zero-drop ramp and retirement: test_canary; the swap's configs:
# unit/release/test_swap.py (meshctl swap --emit)
def test_base_swap_with_meshctl_drops_nothing(released):
    """4 concurrent streams run while `meshctl swap` adds smollm-acme (weight 0), moves
    50/50, then 0/100, then retires smollm-v1. Every stream completes in full. Starts from
    the config the tests above left (local.yaml, smollm-v1 at max_num_seqs 6)."""
    mesh = released
    config = mesh.write(mesh.current)
    before = ask(mesh, "What is the capital of Italy?").json()["choices"][0]["message"]
    assert "Acme Support" not in before["content"], before
    with background_load(load(mesh)) as results:
        time.sleep(BASELINE_S)
        t_swap = time.monotonic()
        swap = meshctl("swap", str(config), "--route", "smollm", "--new-app", "smollm-acme",
                       "--model", "smollm2-135m-acme", "--steps", "50,100", "--pause-s", "5",
                       # the engine args are the running variant's, checked when it started
                       "--skip-engine-check", "-a", mesh.dashboard)
        t_done = time.monotonic()
        wait_for_results(results, AFTER_REQUESTS, started_after=t_done)
        wait_for_results(results, 20)
    assert swap.returncode == 0, swap.stdout

    failed = report("swap", results, t_swap, t_done, f"by variant {by_variant(results)}")
    assert not failed, [(r.status, r.error) for r in failed[:5]]
    assert len(results) >= 20
    assert set(by_variant(results)) == {"smollm-v1", "smollm-acme"}

    r = ask(mesh, "What is the capital of Italy?")
    assert r.status_code == 200 and r.headers["x-mesh-variant"] == "smollm-acme"
    answer = r.json()["choices"][0]["message"]["content"]
    print(f"after the swap: {answer!r}")
    assert answer.startswith(signature(released.engine, "acme-support@v1")), answer

    # The last config is the new desired state: it matches what is deployed now.
    final = re.search(r"the new desired state is (\S+):", swap.stdout).group(1)
    assert final.endswith("04-retire.yaml")
    diff = meshctl("diff", "live", final, "--fail-on-restart", "-a", mesh.dashboard)
    assert diff.returncode == 0 and "  no changes\n" in diff.stdout, diff.stdout
