"""``meshctl top-adapters`` (serve_app/release/merge_plan.py): the ranking from the router's
token counters, and the config it writes validates as a merged variant."""

from __future__ import annotations

import yaml

from serve_app import cli
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml, mesh_parts
from serve_app.release.merge_plan import adapter_tokens, plan_merges
from serve_app.release.validate import validate_config

TENANTS = REPO_ROOT / "serve_configs" / "tenants.yaml"


def series(name: str, adapter: str, value: float, variant: str = "smollm-v1") -> str:
    return (f'{name}{{Component="core_worker",adapter="{adapter}",route="smollm",'
            f'tenant="t",variant="{variant}"}} {value}')


METRICS = "\n".join([
    "# TYPE ray_mesh_prompt_tokens_total counter",
    series("ray_mesh_prompt_tokens_total", "acme-support", 4000),
    series("ray_mesh_prompt_tokens_total", "globex-report", 300),
    series("ray_mesh_prompt_tokens_total", "", 9000),  # the base model: not an adapter
    "# TYPE ray_mesh_completion_tokens_total counter",
    series("ray_mesh_completion_tokens_total", "acme-support", 1000),
    series("ray_mesh_completion_tokens_total", "acme-support", 500, variant="smollm-v2"),
    series("ray_mesh_completion_tokens_total", "globex-report", 100),
]) + "\n"


def test_tokens_are_summed_per_route_and_adapter_over_variants_and_series():
    assert adapter_tokens(METRICS) == {("smollm", "acme-support"): 5500,
                                       ("smollm", "globex-report"): 400}


def test_the_top_adapter_gets_a_merged_variant_on_the_model_built_for_it():
    new, [step] = plan_merges(load_yaml(TENANTS), adapter_tokens(METRICS), top=1)
    assert (step.version, step.application) == ("acme-support@v1", "smollm-acme-support-merged")
    assert step.model == "smollm2-135m-acme" and step.build == ""  # scripts/setup.sh built it
    parts = mesh_parts(new)
    assert parts.router_user_config["routes"]["smollm"]["merged"] == {
        "acme-support": "smollm-acme-support-merged"}
    app = parts.variant_apps["smollm-acme-support-merged"]
    assert "enable_lora" not in app["args"]["engine_args"]
    assert app["deployments"][0]["user_config"] == {}
    assert validate_config(new) == []
    # nothing new when it is already merged
    again, steps = plan_merges(new, adapter_tokens(METRICS), top=1)
    assert steps[0].adapter == "globex-report" and steps[0].build.startswith(
        "python scripts/prepare_model.py --merge-adapter globex-report@v1 --out models/")


def test_meshctl_top_adapters_prints_the_ranking_and_writes_the_config(tmp_path, capsys):
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(METRICS)
    out = tmp_path / "merged.yaml"
    assert cli.main(["top-adapters", str(TENANTS), "--metrics", str(metrics),
                     "--emit", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "smollm:acme-support" in printed and "93.2%" in printed
    assert "merge acme-support@v1 -> smollm-acme-support-merged" in printed
    assert validate_config(yaml.safe_load(out.read_text())) == []
    metrics.write_text("# nothing\n")
    assert cli.main(["top-adapters", str(TENANTS), "--metrics", str(metrics)]) == 1
    assert "no adapter tokens" in capsys.readouterr().err
