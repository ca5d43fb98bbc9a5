"""A catalog of bad Serve configs, each with the one problem ``meshctl validate`` must report.

Each case starts from a shipped config (``serve_configs/<base>``), changes one thing, and
names the problem line it must get, exactly (``{models}``, ``{tmp}`` and ``{repo}`` stand for
this host's paths). ``tests/unit/release/test_validate_catalog.py`` checks every case; add one
with every new refusal. ``engine=True`` cases are vLLM's own verdicts (they import vLLM once:
:data:`serve_app.release.engine_check.VLLM_IMPORT_TIME`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serve_app.common.paths import REPO_ROOT, models_dir

ROUTER = "applications[0].deployments[MeshRouter].user_config"
VARIANT = "applications[1]"
REPLICA_UC = f"{VARIANT}.deployments[LLMReplica].user_config"


@dataclass(frozen=True)
class Case:
    """One bad config.

    Attributes:
        name: what is wrong, as a user would say it.
        base: the shipped config it starts from.
        mutate: changes the config in place; ``tmp`` is a scratch folder for files.
        problem: the line it must get first (a prefix when it ends with "...").
        engine: a verdict of vLLM's (``serve_app.release.engine_check``).
        count: the problems it gets in all (the same one may hit several items).
    """

    name: str
    base: str
    mutate: Callable[[dict[str, Any], Path], None]
    problem: str
    engine: bool = False
    count: int = 1


def router(cfg: dict) -> dict:
    return cfg["applications"][0]["deployments"][0]["user_config"]


def variant_args(cfg: dict) -> dict:
    return cfg["applications"][1]["args"]


def engine_args(**changes) -> Callable[[dict, Path], None]:
    return lambda cfg, tmp: variant_args(cfg)["engine_args"].update(changes)


def tenant(i: int, **changes) -> Callable[[dict, Path], None]:
    return lambda cfg, tmp: router(cfg)["tenants"][i].update(changes)


def manifest_with(**changes) -> Callable[[dict, Path], None]:
    """A copy of the adapter registry in ``tmp`` whose acme-support@v1 has ``changes``; the
    variant reads that one."""
    def mutate(cfg: dict, tmp: Path) -> None:
        registry = yaml.safe_load((REPO_ROOT / "adapters" / "manifest.yaml").read_text())
        for entry in registry["adapters"]:
            if entry["name"] == "acme-support" and entry["version"] == 1:
                entry.update(changes)  # repo-relative uris resolve from the repo root
        path = tmp / "manifest.yaml"
        path.write_text(yaml.safe_dump(registry))
        cfg["applications"][1]["deployments"][0]["user_config"]["adapters_manifest"] = str(path)
    return mutate


def registry_file(ref: str) -> Callable[[dict, Path], None]:
    """The variant's ``adapters_manifest`` set to ``ref``."""
    return lambda cfg, tmp: cfg["applications"][1]["deployments"][0]["user_config"].update(
        adapters_manifest=ref)


def model(name: str) -> Callable[[dict, Path], None]:
    return lambda cfg, tmp: variant_args(cfg).update(model=name)


def models_here() -> str:
    return ", ".join(sorted(p.parent.name for p in models_dir().glob("*/config.json")))


#: A hub commit, for the cases that pin one.
COMMIT = "0e9e39f249a16976918f6564b8830bc894c89659"
#: How a source that would climb out of the node's cache is refused (after ``'<uri>': ``).
CLIMB = ("it has a path part {part}; each part of a bucket folder is a name (not empty, '.' "
         "or '..', also percent-encoded), since the folder is fetched under the node's cache: "
         "write {bucket}/<folder>")

BUDGET = ("is below the smallest request (57 tokens: a chat of one empty message reserves a "
          "prompt bound of 56, plus max_tokens 1), so tenant {tenant!r} would get 400 "
          "reservation_exceeds_budget for every request; set at least 57 (docs/errors.md, "
          "\"What a request reserves\")")

CASES: list[Case] = [
    # -- what is on this host --------------------------------------------------------------
    Case("a model directory that does not exist", "local.yaml", model("nosuchmodel"),
         f"{VARIANT}.args.model: model 'nosuchmodel' not found at {{models}}/nosuchmodel (no "
         "config.json). Build the embedded model with `python scripts/prepare_model.py`, or "
         "set MESH_MODELS_DIR to the folder that holds it; weights from the hub or a bucket: "
         "model: org/name with revision: <commit>, or s3://bucket/prefix (docs/gpu-fleet.md). "
         "Models in {models}: {models_here}."),
    Case("a hub id with no pinned revision", "local.yaml",
         model("meta-llama/Llama-3.1-8B-Instruct"),
         f"{VARIANT}.args.model: 'meta-llama/Llama-3.1-8B-Instruct' is a Hugging Face id "
         "with no revision: pin the commit every replica downloads with `revision: <40-hex "
         "commit hash>` (the hub's 'main' moves; HfApi().model_info(id).sha gives today's)"),
    Case("a hub id pinned to a branch", "local.yaml",
         lambda cfg, tmp: variant_args(cfg).update(model="hf://meta-llama/Llama-3.1-8B",
                                                   revision="main"),
         f"{VARIANT}.args.model: 'hf://meta-llama/Llama-3.1-8B': revision 'main' is not "
         "pinned: a branch or a tag can move between two replicas' starts; give the full "
         "40-hex commit hash"),
    Case("a malformed hub id", "local.yaml",
         lambda cfg, tmp: variant_args(cfg).update(model="meta-llama/Llama 3", revision="a" * 40),
         f"{VARIANT}.args.model: 'meta-llama/Llama 3' is not a Hugging Face model id "
         "(org/name: letters, digits, '-', '_', '.'); a local folder is a bare name under "
         "MESH_MODELS_DIR or a path (/abs/path, ./relative)"),
    Case("a bucket URI with no folder", "local.yaml", model("s3://models"),
         f"{VARIANT}.args.model: 's3://models': name the folder inside the bucket "
         "(s3://models/<prefix>), not the whole bucket"),
    Case("a bucket name S3 refuses", "local.yaml", model("gs://My_Models/llama"),
         f"{VARIANT}.args.model: 'gs://My_Models/llama': 'My_Models' is not a bucket name "
         "(3-63 lowercase letters, digits, '-', '.'); write gs://<bucket>/<prefix>"),
    Case("a bucket URI that climbs out of the cache", "local.yaml",
         model("s3://models/../../../../tmp/victim"),
         f"{VARIANT}.args.model: 's3://models/../../../../tmp/victim': "
         + CLIMB.format(part="'..'", bucket="s3://models")),
    Case("a bucket URI that climbs, percent-encoded", "local.yaml",
         model("gs://models/a/%2e%2e/%2e%2e/etc"),
         f"{VARIANT}.args.model: 'gs://models/a/%2e%2e/%2e%2e/etc': "
         + CLIMB.format(part="'%2e%2e' (percent-encoded '..')", bucket="gs://models")),
    Case("credentials written into a bucket URI", "local.yaml",
         model("s3://AKIAEXAMPLE:wJalrSECRETKEY@my-bucket/llama"),
         f"{VARIANT}.args.model: 's3://***@my-bucket/llama': a URI carries no credentials "
         "(they would show in the config, the dashboard and the logs): remove the "
         "'user:secret@' part and give them in the nodes' environment (AWS_ACCESS_KEY_ID and "
         "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN)"),
    Case("tensor parallelism over the GPUs a replica is granted", "local.yaml",
         lambda cfg, tmp: (engine_args(tensor_parallel_size=3)(cfg, tmp), cfg["applications"][1][
             "deployments"][0].update(ray_actor_options={"num_cpus": 1, "num_gpus": 1})),
         f"{VARIANT}.deployments[LLMReplica]: tensor_parallel_size x pipeline_parallel_size = "
         "3: the engine spans 3 GPUs, and the replica is granted 2 (3 GPU(s) in its "
         "placement_group_bundles, less the 1 its actor takes (ray_actor_options.num_gpus)). "
         "The mesh gives a replica that spans GPUs a placement group of one GPU bundle each "
         "(docs/gpu-fleet.md): leave num_gpus out of its ray_actor_options and "
         "placement_group_bundles out of the deployment, or lower the parallel sizes"),
    Case("a placement group with fewer GPUs than the engine spans", "local.yaml",
         lambda cfg, tmp: (engine_args(tensor_parallel_size=2, pipeline_parallel_size=2)(
             cfg, tmp), cfg["applications"][1]["deployments"][0].update(
             placement_group_bundles=[{"CPU": 1, "GPU": 1}, {"GPU": 1}])),
         f"{VARIANT}.deployments[LLMReplica]: tensor_parallel_size x pipeline_parallel_size = "
         "4: the engine spans 4 GPUs, and the replica is granted 2 (2 GPU(s) in its "
         "placement_group_bundles). The mesh gives a replica that spans GPUs a placement group "
         "of one GPU bundle each (docs/gpu-fleet.md): leave num_gpus out of its "
         "ray_actor_options and placement_group_bundles out of the deployment, or lower the "
         "parallel sizes"),
    Case("an adapter uri that points at no directory", "tenants.yaml",
         manifest_with(uri="adapters/acme-support/v9"),
         f"{REPLICA_UC}.adapters[0]: adapter acme-support@v1: directory "
         "{repo}/adapters/acme-support/v9 (uri 'adapters/acme-support/v9') does not exist; "
         "train it with scripts/train_adapter.py or fix 'uri' in adapters/manifest.yaml"),
    Case("adapter weights that are not the registered ones", "tenants.yaml",
         manifest_with(sha256="0" * 64),
         f"{REPLICA_UC}.adapters[0]: adapter acme-support@v1: SHA-256 mismatch for "
         "{repo}/adapters/acme-support/v1/adapter_model.safetensors: manifest 000000000000..., "
         "file ..."),
    Case("an adapter uri with a scheme the registry cannot read", "tenants.yaml",
         manifest_with(uri="ftp://host/acme-support/v1"),
         f"{REPLICA_UC}.adapters[0]: adapter acme-support@v1: 'ftp://host/acme-support/v1': "
         "scheme 'ftp://' is not supported; use a local path, a Hugging Face id (org/name or "
         "hf://org/name) with a pinned revision, or a bucket (s3://bucket/prefix, "
         "gs://bucket/prefix)"),
    Case("an adapter from the hub with no pinned revision", "tenants.yaml",
         manifest_with(uri="hf://acme/support-lora"),
         f"{REPLICA_UC}.adapters[0]: adapter acme-support@v1: 'hf://acme/support-lora' is a "
         "Hugging Face id with no revision: pin the commit every replica downloads with "
         "`revision: <40-hex commit hash>` (the hub's 'main' moves; HfApi().model_info(id).sha "
         "gives today's)"),
    Case("an adapter uri that climbs out of the cache", "tenants.yaml",
         manifest_with(uri="s3://adapters/../../home/ray/.ssh"),
         f"{REPLICA_UC}.adapters[0]: adapter acme-support@v1: "
         "'s3://adapters/../../home/ray/.ssh': "
         + CLIMB.format(part="'..'", bucket="s3://adapters")),
    Case("an adapter trained for another org's model of the same name", "tenants.yaml",
         manifest_with(base_model="other-org/smollm2-135m-instruct", base_model_revision=COMMIT),
         f"{REPLICA_UC}.adapters[0]: acme-support@v1 cannot be served: trained for "
         f"'hf://other-org/smollm2-135m-instruct@{COMMIT}', but this variant serves "
         f"'smollm2-135m-instruct'; declare it on a variant of "
         f"'hf://other-org/smollm2-135m-instruct@{COMMIT}'"),
    Case("an adapter config that is not the registered one", "tenants.yaml",
         manifest_with(config_sha256="0" * 64),
         f"{REPLICA_UC}.adapters[0]: adapter acme-support@v1: SHA-256 mismatch for "
         "{repo}/adapters/acme-support/v1/adapter_config.json: manifest config_sha256 "
         "000000000000..., file ..."),
    Case("an adapter registry URI that climbs out of the cache", "tenants.yaml",
         registry_file("s3://adapters/../../etc/manifest.yaml"),
         f"{REPLICA_UC}.adapters_manifest: 's3://adapters/../../etc/manifest.yaml': "
         + CLIMB.format(part="'..'", bucket="s3://adapters")),
    Case("an adapter registry on the hub with no commit", "tenants.yaml",
         registry_file("hf://acme/registry/manifest.yaml"),
         f"{REPLICA_UC}.adapters_manifest: 'hf://acme/registry/manifest.yaml': a file on the "
         "hub is written hf://org/name@<40-hex commit>/path/in/repo, pinned to the commit "
         "every replica reads (a branch or a tag moves)"),
    # -- engine args: vLLM's verdict --------------------------------------------------------
    Case("a misspelled engine arg", "local.yaml", engine_args(max_num_seqz=4),
         f"{VARIANT}.args.engine_args.max_num_seqz: vLLM has no engine argument "
         "'max_num_seqz'; did you mean 'max_num_seqs'? use the names of vLLM's "
         "AsyncEngineArgs (`vllm serve --help` lists them as --kebab-case options)",
         engine=True),
    Case("a dtype vLLM does not know", "local.yaml", engine_args(dtype="float33"),
         f"{VARIANT}.args.engine_args.dtype: vLLM refuses 'float33': Input should be 'auto', "
         "'half', 'float16', 'bfloat16', 'float' or 'float32'", engine=True),
    Case("a negative max_num_seqs", "local.yaml", engine_args(max_num_seqs=-3),
         f"{VARIANT}.args.engine_args.max_num_seqs: vLLM refuses -3: Input should be greater "
         "than or equal to 1", engine=True),
    Case("a max_lora_rank vLLM does not support", "local.yaml", engine_args(max_lora_rank=7),
         f"{VARIANT}.args.engine_args.max_lora_rank: vLLM refuses 7: Input should be 1, 8, "
         "16, 32, 64, 128, 256, 320 or 512", engine=True),
    Case("a max_model_len longer than the model's", "local.yaml",
         engine_args(max_model_len=99_999),
         f"{VARIANT}.args.engine_args.max_model_len: vLLM refuses 99999: "
         "User-specified max_model_len (99999) is greater than the derived max_model_len...",
         engine=True),
    # -- tenants -------------------------------------------------------------------------
    Case("a tenant owning a misspelled adapter", "tenants.yaml",
         tenant(2, adapters=["globex-reprot"]),
         f"{ROUTER}.tenants[2].adapters[0]: 'globex-reprot' is declared by no variant of the "
         "routes tenant 'globex' may call (declared: acme-support, globex-report); did you "
         "mean 'globex-report'? fix the name, or declare the adapter in a variant's "
         "LLMReplica user_config.adapters"),
    Case("a daily token budget below the smallest request", "tenants.yaml",
         tenant(1, tokens_per_day=50),
         f"{ROUTER}.tenants[1].tokens_per_day: 50 " + BUDGET.format(tenant="acme")),
    Case("a per-minute token budget below the smallest request", "tenants.yaml",
         tenant(1, tokens_per_minute=56),
         f"{ROUTER}.tenants[1].tokens_per_minute: 56 " + BUDGET.format(tenant="acme")),
    Case("an API key stored in clear", "tenants.yaml", tenant(1, api_keys_sha256=["sk-acme"]),
         f"{ROUTER}.tenants.1.api_keys_sha256: 'sk-acme'... is not a SHA-256 hex "
         "digest (64 lowercase hex characters); store hashes, never keys: meshctl hash-key"),
    Case("a tenant naming an unknown route", "tenants.yaml", tenant(1, routes=["smolm"]),
         f"{ROUTER}: tenant 'acme' names unknown route 'smolm'"),
    Case("one adapter owned by two tenants", "tenants.yaml",
         tenant(2, adapters=["globex-report", "acme-support"]),
         f"{ROUTER}: adapter 'acme-support' is owned by both 'acme' and "
         "'globex'; an adapter belongs to one tenant"),
    # -- routes and variants ------------------------------------------------------------
    Case("a negative weight", "canary.yaml",
         lambda cfg, tmp: router(cfg)["routes"]["smollm"]["variants"][1].update(weight=-1),
         f"{ROUTER}.routes.smollm.variants.1.weight: Input should be greater than or equal "
         "to 0"),
    Case("a route naming a variant that is not in the config", "local.yaml",
         lambda cfg, tmp: router(cfg)["routes"]["smollm"]["variants"][0].update(
             application="smollm-v9"),
         f"{ROUTER}.routes.smollm.variants[0].application: no variant application named "
         "'smollm-v9' in this config; add it or remove it from the route"),
    Case("a variant serving another route's name", "local.yaml",
         lambda cfg, tmp: variant_args(cfg).update(served_model_name="other"),
         f"{ROUTER}.routes.smollm.variants[0].application: 'smollm-v1' serves 'other'; set "
         "its args.served_model_name to 'smollm'"),
    Case("a variant exposed over HTTP", "local.yaml",
         lambda cfg, tmp: cfg["applications"][1].update(route_prefix="/v1"),
         f"{VARIANT}.route_prefix: variant 'smollm-v1' must not be exposed over HTTP; set "
         "`route_prefix: null` (clients go through the router)"),
    Case("an adapter that is not registered", "tenants.yaml",
         lambda cfg, tmp: cfg["applications"][1]["deployments"][0]["user_config"][
             "adapters"].append({"name": "nope", "version": 1}),
         f"{REPLICA_UC}.adapters[2]: nope@v1 is not in the adapter registry"),
    Case("an adapter of a higher rank than the engine's", "tenants.yaml",
         engine_args(max_lora_rank=4),
         f"{REPLICA_UC}.adapters[0]: acme-support@v1 cannot be served: rank 8 is over this "
         "variant's max_lora_rank=4; raise max_lora_rank in the variant's engine args or "
         "retrain with r<=4", count=2),  # and globex-report@v1
]
