"""A relative ``adapters_manifest`` is read from the config file's folder by meshctl, which
deploys the absolute path (serve_app/release/manifest_paths.py). No Ray cluster."""

from __future__ import annotations

import copy

import yaml

from serve_app import cli
from serve_app.common.adapters import load_manifest
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml
from serve_app.release.manifest_paths import (deployable_copy, relative_manifests,
                                              with_config_folder)

TENANTS = load_yaml(REPO_ROOT / "serve_configs" / "tenants.yaml")


def config_beside_its_registry(folder, manifest_ref: str = "registry/manifest.yaml"):
    """``folder/prod.yaml``: tenants.yaml whose variant names ``manifest_ref``; the registry
    (the demo adapters, absolute uris) at ``folder/registry/manifest.yaml``."""
    entries = [{**spec.model_dump(), "uri": str(REPO_ROOT / spec.uri)}
               for spec in load_manifest().values()]
    (folder / "registry").mkdir()
    (folder / "registry" / "manifest.yaml").write_text(yaml.safe_dump({"adapters": entries}))
    cfg = copy.deepcopy(TENANTS)
    cfg["applications"][1]["deployments"][0]["user_config"]["adapters_manifest"] = manifest_ref
    path = folder / "prod.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, cfg


def user_config(cfg):
    return cfg["applications"][1]["deployments"][0]["user_config"]


def test_meshctl_reads_a_relative_registry_from_the_config_folder(tmp_path, capsys):
    """Read from the repository root, the registry beside the config was not found."""
    path, _ = config_beside_its_registry(tmp_path)
    assert cli.main(["validate", str(path), "--skip-engine-check"]) == 0
    assert capsys.readouterr().out == f"{path}: ok\n"
    (tmp_path / "registry" / "manifest.yaml").unlink()
    assert cli.main(["validate", str(path), "--skip-engine-check"]) == 1
    assert (f"adapters_manifest: cannot read adapter manifest "
            f"{tmp_path}/registry/manifest.yaml") in capsys.readouterr().err


def test_deploy_hands_serve_the_absolute_path(tmp_path):
    path, cfg = config_beside_its_registry(tmp_path)
    deployed = deployable_copy(path)
    assert deployed != path and deployed.name == "prod.yaml"
    sent = yaml.safe_load(deployed.read_text())
    assert user_config(sent)["adapters_manifest"] == str(tmp_path / "registry/manifest.yaml")
    sent["applications"][1]["deployments"][0]["user_config"]["adapters_manifest"] = \
        "registry/manifest.yaml"
    assert sent == cfg  # nothing else changed
    assert user_config(yaml.safe_load(path.read_text()))["adapters_manifest"] == \
        "registry/manifest.yaml"  # the user's file is left as it is


def test_absolute_paths_and_uris_are_left_as_they_are(tmp_path):
    for ref in ("/srv/registry/manifest.yaml", "file:///srv/registry/manifest.yaml",
                "s3://acme-registry/manifest.yaml",
                "hf://acme/registry@0e9e39f249a16976918f6564b8830bc894c89659/manifest.yaml"):
        cfg = copy.deepcopy(TENANTS)
        user_config(cfg)["adapters_manifest"] = ref
        assert relative_manifests(cfg) == [] and with_config_folder(cfg, tmp_path / "x.yaml") \
            is cfg
    assert with_config_folder(TENANTS, tmp_path / "x.yaml") is TENANTS  # none named
    assert deployable_copy(REPO_ROOT / "serve_configs" / "tenants.yaml") == \
        REPO_ROOT / "serve_configs" / "tenants.yaml"
