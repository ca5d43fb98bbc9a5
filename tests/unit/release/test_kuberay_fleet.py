"""What a fleet adds to ``meshctl kuberay``'s pods (:mod:`serve_app.release.kuberay_fleet`):
secrets as environment, the node cache volume, node selectors per accelerator type and
tolerations, from a fleet file merged into every regenerated manifest (``--overlay``)."""

from __future__ import annotations

import copy

import pytest
import yaml

from serve_app import cli
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.release.kuberay import ManifestError, manifest_warnings, rayservice_manifest
from serve_app.release.kuberay_fleet import CACHE_PATH, GPU_TOLERATION

FLEET_CONFIG = REPO_ROOT / "tests/support/configs/first_day_fleet.yaml"
FLEET_FILE = {
    "secrets": ["model-mesh-credentials"],
    "secret_env": {"HF_TOKEN": {"secret": "hf", "key": "token"}},
    "env": {"HF_HUB_DISABLE_TELEMETRY": "1"},
    "service_account": "model-mesh",
    "cache": {"hostPath": {"path": "/var/cache/model-mesh", "type": "DirectoryOrCreate"}},
    "workers": {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm",
                                 "effect": "NoSchedule"}]},
    "head": {"node_selector": {"pool": "system"}},
    "accelerators": {"H100": {"node_selector": {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}},
}


def config() -> dict:
    cfg = copy.deepcopy(load_yaml(FLEET_CONFIG))
    for app in cfg["applications"]:
        for dep in app.get("deployments") or []:
            uc = dep.get("user_config") or {}
            if "adapters_manifest" in uc:
                uc["adapters_manifest"] = str(REPO_ROOT / uc["adapters_manifest"])
    return cfg


def workers(manifest: dict) -> list[dict]:
    return manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def test_without_a_fleet_file_the_pods_get_an_optional_secret_and_a_cache():
    manifest = rayservice_manifest(config(), name="mesh-prod")
    for group in workers(manifest):
        spec = group["template"]["spec"]
        [c] = spec["containers"]
        assert c["envFrom"] == [{"secretRef": {"name": "mesh-prod-credentials",
                                               "optional": True}}]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["MESH_CACHE_DIR"] == CACHE_PATH
        assert env["HF_HOME"] == f"{CACHE_PATH}/huggingface"
        assert spec["volumes"] == [{"name": "model-cache", "emptyDir": {}}]
        assert c["volumeMounts"] == [{"name": "model-cache", "mountPath": CACHE_PATH}]
        assert spec["tolerations"] == [GPU_TOLERATION]  # GPU node pools' taint
        assert "nodeSelector" not in spec
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "envFrom" not in head["containers"][0] and "volumes" not in head
    # and a warning: nothing keeps the H100 groups on H100 nodes
    warnings = manifest_warnings(config(), manifest)
    assert [w.split(":")[0] for w in warnings] == ["workerGroupSpecs[engines-gpu1-h100]",
                                                  "workerGroupSpecs[engines-gpu2-h100]"]
    assert all("no node selector keeps its pods on such nodes" in w for w in warnings)


def test_a_fleet_file_is_merged_into_every_engine_pod():
    manifest = rayservice_manifest(config(), overlay=FLEET_FILE)
    for group in workers(manifest):
        spec = group["template"]["spec"]
        [c] = spec["containers"]
        assert c["envFrom"] == [{"secretRef": {"name": "model-mesh-credentials"}}]
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "hf", "key": "token"}}} in c["env"]
        assert {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"} in c["env"]
        assert spec["volumes"] == [{"name": "model-cache", "hostPath": {
            "path": "/var/cache/model-mesh", "type": "DirectoryOrCreate"}}]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert spec["tolerations"] == [GPU_TOLERATION, {
            "key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}]
        assert spec["serviceAccountName"] == "model-mesh"
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"] == {"pool": "system"}
    assert manifest_warnings(config(), manifest, overlay=FLEET_FILE) == []
    # the Serve config is untouched: secrets never go into serveConfigV2
    assert "hf" not in yaml.safe_load(manifest["spec"]["serveConfigV2"]).get("env", {})


@pytest.mark.parametrize("overlay, problem", [
    ({"secrets": ["HF_Token"]}, "overlay.secrets: 'HF_Token' is not a Kubernetes Secret name"),
    ({"secret_env": {"HF TOKEN": {"secret": "hf", "key": "token"}}},
     "overlay.secret_env: 'HF TOKEN' is not an environment variable name"),
    ({"env": {"MESH_CACHE_DIR": "/data"}}, "overlay.env: MESH_CACHE_DIR is the mesh's"),
    ({"cache": {"hostpath": {"path": "/x"}}}, "overlay.cache: got {'hostpath': {'path': "),
    ({"accelerators": {"H-100": {}}}, "overlay.accelerators: 'H-100' is not an "
                                      "accelerator_type Ray knows"),
    ({"workers": {"tolerations": [{"operator": "Equal", "value": "x"}]}},
     "overlay.workers.tolerations.0: a toleration without a key"),
    ({"workers": {"node_selector": ["pool=gpu"]}}, "overlay.workers.node_selector: "),
    ({"tolerations": []}, "overlay.tolerations: "),
])
def test_a_bad_fleet_file_is_refused_naming_the_field(overlay, problem):
    with pytest.raises(ManifestError) as e:
        rayservice_manifest(config(), overlay=overlay)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(problem), \
        e.value.problems


def test_regenerating_with_the_fleet_file_keeps_what_it_adds(tmp_path, capsys):
    """The fleet's additions live in its file, not in the manifest: a regenerated manifest
    (here after a change of weights) has them all again."""
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET_FILE))
    cfg = config()
    path = tmp_path / "config.yaml"
    out = tmp_path / "rayservice.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert cli.main(["kuberay", str(path), "--overlay", str(fleet_file), "-o", str(out)]) == 0
    first = yaml.safe_load(out.read_text())
    routes = cfg["applications"][0]["deployments"][0]["user_config"]["routes"]
    routes["llama"]["variants"][0]["weight"], routes["llama"]["variants"][1]["weight"] = 50, 50
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert cli.main(["kuberay", str(path), "--overlay", str(fleet_file), "-o", str(out)]) == 0
    second = yaml.safe_load(out.read_text())
    assert first["spec"]["rayClusterConfig"] == second["spec"]["rayClusterConfig"]
    assert first["spec"]["serveConfigV2"] != second["spec"]["serveConfigV2"]
    text = out.read_text()
    assert f"meshctl kuberay {path} --overlay {fleet_file}" in text.splitlines()[0]
    assert "# sized: workerGroupSpecs[engines-gpu2-h100]: llama-v2: 4 CPUs, 31Gi" in text
    err = capsys.readouterr().err
    assert "WARNING" not in err and "Traceback" not in err


def test_an_unreadable_fleet_file_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config(), sort_keys=False))
    assert cli.main(["kuberay", str(path), "--overlay", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
