"""Unit tests (no Ray cluster) of ``meshctl kuberay``: Serve config -> KubeRay RayService
manifest (:mod:`serve_app.release.kuberay`)."""

from __future__ import annotations

import copy
import json
import shlex

import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app import cli
from serve_app.common import deployment_options
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import deployment, load_yaml
from serve_app.release import kuberay
from serve_app.release.validate import validate_config

CONFIGS = sorted((REPO_ROOT / "serve_configs").glob("*.yaml"))
GiB = 2**30


def generate(config, **options):
    """The manifest as `meshctl kuberay` writes it, parsed back, and its text."""
    text = kuberay.manifest_yaml(kuberay.rayservice_manifest(config, **options), source="x.yaml")
    return yaml.safe_load(text), text


def cluster(manifest):
    return manifest["spec"]["rayClusterConfig"]


def groups(manifest):
    return {g["groupName"]: g for g in cluster(manifest)["workerGroupSpecs"]}


def container(group_or_head):
    [c] = group_or_head["template"]["spec"]["containers"]
    return c


def app(config, name):
    return next(a for a in config["applications"] if a["name"] == name)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_round_trips(path):
    config = load_yaml(path)
    manifest, text = generate(config, name="mesh-prod", image="registry.example/mesh:1")
    assert manifest["apiVersion"] == "ray.io/v1"
    assert manifest["kind"] == "RayService"
    assert manifest["metadata"]["name"] == "mesh-prod"
    assert "\n  serveConfigV2: |\n" in text  # a readable literal block, not a quoted string

    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(served)
    assert validate_config(served) == []
    expected = copy.deepcopy(config)
    expected["http_options"]["host"] = "0.0.0.0"  # the only change
    assert served == expected
    assert served["http_options"]["port"] == 8000

    rc = cluster(manifest)
    assert rc["rayVersion"] == ray.__version__
    head = rc["headGroupSpec"]
    assert "num-cpus" not in head["rayStartParams"]  # the router and controller run there
    ray_head = container(head)
    assert ray_head["image"] == "registry.example/mesh:1"
    assert ray_head["resources"]["limits"] == {"cpu": "2", "memory": "8Gi"}
    assert {p["name"]: p["containerPort"] for p in ray_head["ports"]} == {
        "gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}
    # Every shipped variant runs on the default options ({"num_cpus": 0.5}): one CPU group.
    [group] = rc["workerGroupSpecs"]
    variants = [a["deployments"][0] for a in config["applications"]
                if a["import_path"] == "serve_app.replica:build_app"]  # one pod per replica

    def counts(d):  # (initial, min, max) replicas
        if "autoscaling_config" not in d:
            return (d.get("num_replicas", 1),) * 3
        s = d["autoscaling_config"]
        return s.get("initial_replicas", s["min_replicas"]), s["min_replicas"], s["max_replicas"]
    expected = tuple(sum(c) for c in zip(*map(counts, variants)))
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == expected
    # scale_to_zero.yaml's canary autoscales: the Ray autoscaler adds and removes its pod.
    assert rc["enableInTreeAutoscaling"] is any("autoscaling_config" in d for d in variants)


def test_canary_two_variants_make_two_engine_pods():
    manifest, _ = generate(load_yaml(REPO_ROOT / "serve_configs/canary.yaml"))
    assert list(groups(manifest)) == ["engines-cpu"]
    g = groups(manifest)["engines-cpu"]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (2, 2, 2)
    assert g["rayStartParams"] == {}
    worker = container(g)
    assert worker["image"] == "model-mesh:latest"
    # num_cpus 0.5 -> a 1-CPU pod; no memory in ray_actor_options -> --worker-memory (8Gi).
    assert worker["resources"] == {"requests": {"cpu": "1", "memory": "8Gi"},
                                   "limits": {"cpu": "1", "memory": "8Gi"}}
    assert worker["ports"] == [{"containerPort": 8080, "name": "metrics"}]
    assert cluster(manifest)["enableInTreeAutoscaling"] is False


def test_default_actor_options_come_from_the_deployment_options_table(monkeypatch):
    monkeypatch.setitem(deployment_options.REPLICA_OPTIONS, "ray_actor_options",
                        {"num_cpus": 2.5})
    manifest, _ = generate(load_yaml(REPO_ROOT / "serve_configs/local.yaml"),
                           worker_memory="12Gi")
    worker = container(groups(manifest)["engines-cpu"])
    assert worker["resources"]["limits"] == {"cpu": "3", "memory": "12Gi"}


def test_gpu_variant_with_custom_resources_gets_its_own_group():
    config = load_yaml(REPO_ROOT / "serve_configs/canary.yaml")
    dep = deployment(app(config, "smollm-v2"), "LLMReplica")
    dep["num_replicas"] = 2
    dep["ray_actor_options"] = {"num_cpus": 4, "num_gpus": 1, "memory": 24 * GiB,
                                "resources": {"a100_engine": 1}}
    manifest, _ = generate(config)
    assert list(groups(manifest)) == ["engines-cpu", "engines-gpu1-a100-engine"]
    cpu, gpu = groups(manifest).values()
    assert (cpu["replicas"], cpu["maxReplicas"]) == (1, 1)  # smollm-v1 alone
    assert (gpu["replicas"], gpu["minReplicas"], gpu["maxReplicas"]) == (2, 2, 2)
    # the 24 GiB asked for, + 1 GiB for Ray's own processes on the pod
    assert container(gpu)["resources"]["limits"] == {
        "cpu": "4", "memory": "25Gi", "nvidia.com/gpu": "1"}
    assert gpu["rayStartParams"]["num-gpus"] == "1"
    # KubeRay's documented form, backslashes included; `ray start` gets the JSON after the
    # shell removes the outer quotes.
    assert gpu["rayStartParams"]["resources"] == '"{\\"a100_engine\\": 1}"'
    [arg] = shlex.split(gpu["rayStartParams"]["resources"])
    assert json.loads(arg) == {"a100_engine": 1}
    # The config itself goes in unchanged, ray_actor_options included.
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert deployment(app(served, "smollm-v2"), "LLMReplica")["ray_actor_options"] == \
        dep["ray_actor_options"]


def test_config_actor_options_replace_the_code_defaults_whole():
    """As in Serve: ray_actor_options without num_cpus means Serve's default 1, not 0.5;
    a GPU pod is then raised to what its engine runs: 2 CPUs (the actor, the engine core on
    the GPU), 2 + 4 GiB and the 269 MB of weights, + 1 GiB for Ray's processes."""
    config = load_yaml(REPO_ROOT / "serve_configs/local.yaml")
    deployment(app(config, "smollm-v1"), "LLMReplica")["ray_actor_options"] = {"num_gpus": 1}
    manifest, _ = generate(config)
    assert container(groups(manifest)["engines-gpu1"])["resources"]["limits"] == {
        "cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"}
    deployment(app(config, "smollm-v1"), "LLMReplica")["ray_actor_options"] = {
        "num_gpus": 1, "num_cpus": 6, "memory": 12 * GiB}  # more than it needs: kept
    manifest, _ = generate(config)
    assert container(groups(manifest)["engines-gpu1"])["resources"]["limits"] == {
        "cpu": "6", "memory": "13Gi", "nvidia.com/gpu": "1"}


def test_autoscaling_is_kept_and_sizes_the_group():
    config = load_yaml(REPO_ROOT / "serve_configs/canary.yaml")
    v1 = deployment(app(config, "smollm-v1"), "LLMReplica")
    del v1["num_replicas"]
    v1["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 3,
                                "target_ongoing_requests": 4}
    v2 = deployment(app(config, "smollm-v2"), "LLMReplica")
    del v2["num_replicas"]
    v2["autoscaling_config"] = {"min_replicas": 0, "initial_replicas": 1, "max_replicas": 2}
    manifest, _ = generate(config)
    g = groups(manifest)["engines-cpu"]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (2, 1, 5)
    assert cluster(manifest)["enableInTreeAutoscaling"] is True
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert deployment(app(served, "smollm-v1"), "LLMReplica")["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}
    assert deployment(app(served, "smollm-v2"), "LLMReplica")["autoscaling_config"] == {
        "min_replicas": 0, "initial_replicas": 1, "max_replicas": 2}


def test_num_replicas_auto_uses_serves_default_autoscaling():
    config = load_yaml(REPO_ROOT / "serve_configs/local.yaml")
    deployment(app(config, "smollm-v1"), "LLMReplica")["num_replicas"] = "auto"
    manifest, _ = generate(config)
    g = groups(manifest)["engines-cpu"]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 1, 100)
    assert cluster(manifest)["enableInTreeAutoscaling"] is True


def test_router_autoscaling_alone_turns_on_the_autoscaler():
    config = load_yaml(REPO_ROOT / "serve_configs/local.yaml")
    router = deployment(app(config, "mesh"), "MeshRouter")
    del router["num_replicas"]
    router["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2}
    manifest, _ = generate(config)
    g = groups(manifest)["engines-cpu"]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 1, 1)
    assert cluster(manifest)["enableInTreeAutoscaling"] is True


def test_spare_workers_raise_max_replicas_and_turn_on_the_autoscaler():
    manifest, _ = generate(load_yaml(REPO_ROOT / "serve_configs/canary.yaml"), spare_workers=1)
    g = groups(manifest)["engines-cpu"]
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (2, 2, 3)
    assert cluster(manifest)["enableInTreeAutoscaling"] is True


def test_http_port_is_kept_and_host_set_when_absent():
    config = load_yaml(REPO_ROOT / "serve_configs/local.yaml")
    config["http_options"] = {"host": "127.0.0.1", "port": 8123}
    manifest, _ = generate(config)
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert served["http_options"] == {"host": "0.0.0.0", "port": 8123}
    ports = {p["name"]: p["containerPort"] for p in container(
        cluster(manifest)["headGroupSpec"])["ports"]}
    assert ports["serve"] == 8123
    del config["http_options"]
    served = yaml.safe_load(generate(config)[0]["spec"]["serveConfigV2"])
    assert served["http_options"] == {"host": "0.0.0.0", "port": 8000}


def test_bad_options_are_all_reported():
    with pytest.raises(kuberay.ManifestError) as e:
        kuberay.rayservice_manifest(load_yaml(REPO_ROOT / "serve_configs/local.yaml"),
                                    name="Model_Mesh", worker_memory="8GB", head_cpus=0)
    assert [p.split(":")[0] for p in e.value.problems] == ["name", "head_cpus",
                                                            "worker_memory"]
    assert "DNS-1035" in e.value.problems[0]


def test_quantities():
    assert kuberay.parse_quantity("8Gi") == 8 * GiB
    assert kuberay.parse_quantity("512Mi") == 512 * 2**20
    assert kuberay.parse_quantity("1G") == 10**9
    assert kuberay.parse_quantity(1000) == 1000
    assert kuberay.format_quantity(24 * GiB) == "24Gi"
    assert kuberay.format_quantity(1536 * 2**20) == "1536Mi"
    assert kuberay.format_quantity(10**9) == "1000000000"
    for bad in ("8GB", "-1Gi", "0", ""):
        with pytest.raises(ValueError):
            kuberay.parse_quantity(bad)


# ---------------------------------------------------------------------------------------------
# through the CLI
# ---------------------------------------------------------------------------------------------

def write(tmp_path, config, name="config.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_cli_writes_the_manifest_to_a_file(tmp_path, capsys):
    out = tmp_path / "rayservice.yaml"
    rc = cli.main(["kuberay", str(REPO_ROOT / "serve_configs/canary.yaml"), "-o", str(out),
                   "--name", "mesh-canary", "--image", "reg.example/mesh:2",
                   "--head-cpus", "4", "--head-memory", "16Gi", "--worker-memory", "6Gi"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == (
        f"wrote {out}: RayService mesh-canary, worker groups engines-cpu (2 pods of 1 CPUs, "
        "6Gi)")
    # Both warnings the shipped configs earn on Kubernetes.
    assert "WARNING proxy_location: HeadOnly" in captured.err
    assert "WARNING workerGroupSpecs[engines-cpu]: its engines ask Ray only for CPUs" in \
        captured.err
    manifest = yaml.safe_load(out.read_text())
    assert manifest["metadata"]["name"] == "mesh-canary"
    head = container(cluster(manifest)["headGroupSpec"])
    assert head["image"] == "reg.example/mesh:2"
    assert head["resources"]["limits"] == {"cpu": "4", "memory": "16Gi"}
    assert container(groups(manifest)["engines-cpu"])["resources"]["limits"] == {
        "cpu": "1", "memory": "6Gi"}


def test_cli_prints_to_stdout(capsys):
    assert cli.main(["kuberay", str(REPO_ROOT / "serve_configs/local.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# KubeRay RayService written by `meshctl kuberay ")
    assert yaml.safe_load(out)["kind"] == "RayService"


def test_cli_refuses_a_config_ray_refuses(tmp_path, capsys):
    config = load_yaml(REPO_ROOT / "serve_configs/local.yaml")
    deployment(app(config, "smollm-v1"), "LLMReplica")["num_replicas"] = "many"
    out = tmp_path / "rayservice.yaml"
    assert cli.main(["kuberay", str(write(tmp_path, config)), "-o", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("config.yaml: INVALID (no manifest written)")
    assert any(line.startswith("  applications.1.deployments.0") and "many" in line
               for line in err[1:]), err
    assert not out.exists()


def test_cli_refuses_a_config_the_mesh_refuses(tmp_path):
    """Through a real `python -m serve_app.cli` process: exit status and stderr."""
    import subprocess
    import sys

    config = load_yaml(REPO_ROOT / "serve_configs/local.yaml")
    router = deployment(app(config, "mesh"), "MeshRouter")
    router["user_config"]["routes"]["smollm"]["variants"][0]["application"] = "smollm-v9"
    app(config, "smollm-v1")["route_prefix"] = "/v1-direct"
    out = tmp_path / "rayservice.yaml"
    proc = subprocess.run([sys.executable, "-m", "serve_app.cli", "kuberay",
                           str(write(tmp_path, config)), "-o", str(out), "--name", "Bad_Name"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                          check=False)
    assert proc.returncode == 1
    assert proc.stdout == ""
    problems = proc.stderr.splitlines()[1:]
    assert problems == [
        ("  name: got 'Bad_Name'; KubeRay needs a DNS-1035 label (lowercase letters, digits "
         "and '-', starting with a letter) of at most 47 characters"),
        ("  applications[1].route_prefix: variant 'smollm-v1' must not be exposed over HTTP; "
         "set `route_prefix: null` (clients go through the router)"),
        ("  applications[0].deployments[MeshRouter].user_config.routes.smollm.variants[0]."
         "application: no variant application named 'smollm-v9' in this config; add it or "
         "remove it from the route"),
    ]
    assert not out.exists()


@pytest.mark.parametrize("ingress", ["proxy", "haproxy"])
def test_every_pod_gets_the_meshs_serve_settings_for_the_ingress(ingress, monkeypatch):
    from serve_app.common.serve_env import INGRESS_VAR, serve_env

    monkeypatch.delenv(INGRESS_VAR, raising=False)
    manifest, _ = generate(load_yaml(REPO_ROOT / "serve_configs/canary.yaml"), ingress=ingress)
    from serve_app.release.kuberay import IMAGE_HAPROXY_LAUNCHER

    expected = [{"name": k, "value": v}
                for k, v in serve_env(ingress, IMAGE_HAPROXY_LAUNCHER).items()]
    pods = [cluster(manifest)["headGroupSpec"], *cluster(manifest)["workerGroupSpecs"]]
    # the engine pods also point the node cache at their cache volume
    assert [container(p)["env"][:len(expected)] for p in pods] == [expected] * len(pods)
    assert container(pods[0])["env"] == expected
    env = {e["name"]: e["value"] for e in expected}
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == ("1" if ingress == "haproxy" else "0")
    # Ray runs HAProxy through the image's launcher, not a path of the host that generated it
    assert env.get("RAY_SERVE_HAPROXY_BINARY_PATH") == (
        "/home/ray/anaconda3/bin/mesh-haproxy" if ingress == "haproxy" else None)
    # HAProxy takes the same serve port KubeRay's Service and health checks use
    ports = {p["name"]: p["containerPort"] for p in container(pods[0])["ports"]}
    assert ports["serve"] == 8000
    # ... and the replicas' ports, on the pod's address, reach HAProxy on other pods
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"])["http_options"]["host"] == "0.0.0.0"
    monkeypatch.setenv(INGRESS_VAR, ingress)  # the default follows $MESH_INGRESS
    assert generate(load_yaml(REPO_ROOT / "serve_configs/canary.yaml"))[0] == manifest


def test_an_unknown_ingress_is_refused_with_the_others():
    with pytest.raises(kuberay.ManifestError) as e:
        kuberay.rayservice_manifest(load_yaml(REPO_ROOT / "serve_configs/canary.yaml"),
                                    ingress="nginx", head_cpus=0)
    assert len(e.value.problems) == 2
    assert any(p.startswith("ingress: MESH_INGRESS='nginx'") for p in e.value.problems)
