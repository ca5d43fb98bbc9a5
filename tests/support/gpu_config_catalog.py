"""Bad GPU configs, each with the one problem ``meshctl validate`` must report (the same
:class:`~tests.support.config_catalog.Case` as the rest of the catalog): engine-arg values
vLLM refuses without the model (offline), engine args against a model's ``config.json``,
and the Ray resources of a replica against its engine and its placement group.

Most start from ``tests/support/configs/first_day_fleet.yaml``, a new user's H100 config
(``llama-v1``: one GPU, its own ``ray_actor_options``; ``llama-v2``: tensor parallel 2 on the
mesh's placement group); the checks against a model's ``config.json`` use the embedded
model's folder (9 attention heads, a context of 8192), whose ``config.json`` is here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.support.config_catalog import Case

FLEET = "tests/support/configs/first_day_fleet.yaml"
V1 = "applications[1]"  # llama-v1: one GPU, ray_actor_options {num_cpus: 4, num_gpus: 1, ...}
V2 = "applications[2]"  # llama-v2: tensor_parallel_size 2, the mesh's placement group
V1_DEP = f"{V1}.deployments[LLMReplica]"
V2_DEP = f"{V2}.deployments[LLMReplica]"
HINT = 'docs/gpu-fleet.md, "Pod sizing"'


def engine(app: int, **changes) -> Callable[[dict, Path], None]:
    return lambda cfg, tmp: cfg["applications"][app]["args"]["engine_args"].update(changes)


def args(app: int, **changes) -> Callable[[dict, Path], None]:
    return lambda cfg, tmp: cfg["applications"][app]["args"].update(changes)


def dep(app: int, **changes) -> Callable[[dict, Path], None]:
    return lambda cfg, tmp: cfg["applications"][app]["deployments"][0].update(changes)


def actor(app: int, **changes) -> Callable[[dict, Path], None]:
    def mutate(cfg: dict, tmp: Path) -> None:
        cfg["applications"][app]["deployments"][0].setdefault("ray_actor_options", {}).update(
            changes)
    return mutate


def both(*mutations: Callable[[dict, Path], None]) -> Callable[[dict, Path], None]:
    def mutate(cfg: dict, tmp: Path) -> None:
        for m in mutations:
            m(cfg, tmp)
    return mutate


def local_gpu(**engine_args) -> Callable[[dict, Path], None]:
    """local.yaml's variant as an L4 GPU variant (the embedded model's folder is here)."""
    return both(args(1, accelerator_type="L4"), engine(1, **engine_args))


GiB = 2**30
#: llama-v2's bundles as the mesh builds them (tests/unit/common/test_deployment_options.py
#: holds the shape).
B = [{"GPU": 1, "CPU": 3, "memory": 17 * GiB, "accelerator_type:H100": 0.001},
     {"GPU": 1, "CPU": 1, "memory": 13 * GiB, "accelerator_type:H100": 0.001}]

GPU_CASES: list[Case] = [
    Case("a gpu_memory_utilization over 1", FLEET, engine(2, gpu_memory_utilization=1.5),
         'applications[2].args.engine_args.gpu_memory_utilization: vLLM refuses 1.5: Input '
         'should be less than or equal to 1', engine=True),
    Case("a negative gpu_memory_utilization", FLEET, engine(2, gpu_memory_utilization=-0.1),
         'applications[2].args.engine_args.gpu_memory_utilization: vLLM refuses -0.1: Input '
         'should be greater than 0', engine=True),
    Case("a gpu_memory_utilization in words", FLEET, engine(2, gpu_memory_utilization="high"),
         "applications[2].args.engine_args.gpu_memory_utilization: vLLM refuses 'high': Input "
         'should be a valid number, unable to parse string as a number', engine=True),
    Case("a gpu_memory_utilization of 0", FLEET, engine(2, gpu_memory_utilization=0),
         'applications[2].args.engine_args.gpu_memory_utilization: vLLM refuses 0: Input '
         'should be greater than 0', engine=True),
    Case("dtype bf16 (vLLM's word is bfloat16)", FLEET, engine(1, dtype="bf16"),
         "applications[1].args.engine_args.dtype: vLLM refuses 'bf16': Input should be "
         "'auto', 'half', 'float16', 'bfloat16', 'float' or 'float32'", engine=True),
    Case("dtype fp16 (vLLM's word is float16)", FLEET, engine(1, dtype="fp16"),
         "applications[1].args.engine_args.dtype: vLLM refuses 'fp16': Input should be "
         "'auto', 'half', 'float16', 'bfloat16', 'float' or 'float32'", engine=True),
    Case("a max_model_len in kilo-tokens", FLEET, engine(1, max_model_len="32k"),
         "applications[1].args.engine_args.max_model_len: vLLM refuses '32k': Input should be "
         'a valid integer, unable to parse string as an integer', engine=True),
    Case("a negative max_model_len", FLEET, engine(1, max_model_len=-5),
         'applications[1].args.engine_args.max_model_len: vLLM refuses -5: Input should be '
         'greater than or equal to -1', engine=True),
    Case("a max_model_len of true", FLEET, engine(1, max_model_len=True),
         'applications[1].args.engine_args.max_model_len: vLLM refuses True: Input should be '
         'a valid integer (not true or false)', engine=True),
    Case("a max_num_seqs of 0", FLEET, engine(1, max_num_seqs=0),
         'applications[1].args.engine_args.max_num_seqs: vLLM refuses 0: Input should be '
         'greater than or equal to 1', engine=True),
    Case("a fractional max_num_seqs", FLEET, engine(1, max_num_seqs=2.5),
         'applications[1].args.engine_args.max_num_seqs: vLLM refuses 2.5: Input should be a '
         'valid integer, got a number with a fractional part', engine=True),
    Case("a negative max_num_batched_tokens", FLEET, engine(1, max_num_batched_tokens=-1),
         'applications[1].args.engine_args.max_num_batched_tokens: vLLM refuses -1: Input '
         'should be greater than or equal to 1', engine=True),
    Case("a kv_cache_dtype vLLM does not know", FLEET, engine(1, kv_cache_dtype="fp9"),
         "applications[1].args.engine_args.kv_cache_dtype: vLLM refuses 'fp9': Input should "
         "be 'auto', 'float16', 'bfloat16', 'fp8...", engine=True),
    Case("a quantization method vLLM does not know", FLEET, engine(1, quantization="awq2"),
         "applications[1].args.engine_args.quantization: vLLM refuses 'awq2': not one of its "
         'quantization methods (awq, auto_awq, ...', engine=True),
    Case("a scheduling_policy vLLM does not know", FLEET, engine(1, scheduling_policy="lifo"),
         "applications[1].args.engine_args.scheduling_policy: vLLM refuses 'lifo': Input "
         "should be 'fcfs' or 'priority'", engine=True),
    Case("fewer max_cpu_loras than max_loras", FLEET, engine(1, max_cpu_loras=2),
         'applications[1].args.engine_args.max_cpu_loras: vLLM refuses 2: max_cpu_loras (2) '
         'must be >= max_loras (4).', engine=True),
    Case("a block_size in words", FLEET, engine(2, block_size="sixteen"),
         "applications[2].args.engine_args.block_size: vLLM refuses 'sixteen': Input should "
         'be a valid integer, unable to parse string as an integer', engine=True),
    Case("an enforce_eager that is no boolean", FLEET, engine(2, enforce_eager="maybe"),
         "applications[2].args.engine_args.enforce_eager: vLLM refuses 'maybe': Input should "
         'be a valid boolean, unable to interpret input', engine=True),
    Case("tensor parallelism that does not divide the attention heads", "local.yaml",
         local_gpu(tensor_parallel_size=2),
         'applications[1].args.engine_args.tensor_parallel_size: vLLM refuses 2: Total number '
         'of attention heads (9) must be divisible by tensor parallel size (2).', engine=True),
    Case("a GPU variant's max_model_len longer than the model's", "local.yaml",
         local_gpu(max_model_len=99_999),
         'applications[1].args.engine_args.max_model_len: vLLM refuses 99999: User-specified '
         'max_model_len (99999) is greater than...', engine=True),
    Case("num_gpus as a string", FLEET, actor(1, num_gpus="1"),
         "applications[1].deployments[LLMReplica].ray_actor_options.num_gpus: got '1' (a "
         'string); write the number without quotes, e.g. num_gpus: 1'),
    Case("num_cpus as a string", FLEET, actor(1, num_cpus="4"),
         "applications[1].deployments[LLMReplica].ray_actor_options.num_cpus: got '4' (a "
         'string); write the number without quotes, e.g. num_cpus: 4'),
    Case("num_gpus as a boolean", FLEET, actor(1, num_gpus=True),
         'applications[1].deployments[LLMReplica].ray_actor_options.num_gpus: got true; Ray '
         'takes a number here, e.g. num_gpus: 1'),
    Case("memory as a Kubernetes quantity", FLEET, actor(1, memory="64Gi"),
         "applications[1].deployments[LLMReplica].ray_actor_options.memory: got '64Gi' (a "
         'string); Ray takes a number here, e.g. memory: 68719476736 (bytes: 64 GiB)'),
    Case("a negative num_gpus", FLEET, actor(1, num_gpus=-1),
         'applications[1].deployments[LLMReplica].ray_actor_options.num_gpus: got -1; a Ray '
         'resource quantity cannot be negative: give 0 or more'),
    Case("one and a half GPUs for an engine on one", FLEET, actor(1, num_gpus=1.5),
         'applications[1].deployments[LLMReplica].ray_actor_options.num_gpus: got 1.5, but '
         'the engine runs on one GPU (tensor_parallel_size x pipeline_parallel_size = 1), so '
         'the replica would hold 1.5 and use 1; set num_gpus: 1'),
    Case("two GPUs for an engine on one", FLEET, actor(1, num_gpus=2),
         'applications[1].deployments[LLMReplica].ray_actor_options.num_gpus: got 2, but the '
         'engine runs on one GPU (tensor_parallel_size x pipeline_parallel_size = 1), so the '
         'replica would hold 2 and use 1; set tensor_parallel_size: 2 in args.engine_args '
         '(then remove num_gpus: the mesh gives the replica one bundle per GPU) or num_gpus: 1'),
    Case("half a GPU with 90 % of its memory", FLEET, actor(1, num_gpus=0.5),
         'applications[1].args.engine_args.gpu_memory_utilization: 0.9 is over the share of a '
         'GPU the replica is granted '
         '(applications[1].deployments[LLMReplica].ray_actor_options.num_gpus: 0.5): Ray may '
         'place another replica on the rest of that GPU, and the second engine to start finds '
         'too little memory; set gpu_memory_utilization to at most 0.5, or num_gpus: 1'),
    Case("a GPU share finer than Ray counts", FLEET, actor(1, num_gpus=0.00001),
         'applications[1].deployments[LLMReplica].ray_actor_options.num_gpus: got 1e-05; Ray '
         'counts resources in steps of 0.0001: round it to 4 decimals'),
    Case("a custom resource as a string", FLEET, actor(1, resources={"mesh_engine": "1"}),
         'applications[1].deployments[LLMReplica].ray_actor_options.resources.mesh_engine: '
         "got '1' (a string); write the number without quotes, e.g. mesh_engine: 1"),
    Case("GPUs asked for through resources", FLEET, actor(1, resources={"GPU": 1}),
         'applications[1].deployments[LLMReplica].ray_actor_options.resources.GPU: Ray takes '
         'GPU from ray_actor_options.num_gpus, not from resources; move it there'),
    Case("an accelerator_type Ray does not know, in ray_actor_options", FLEET,
         actor(1, accelerator_type="H1000"),
         "applications[1].deployments[LLMReplica].ray_actor_options.accelerator_type: 'H1000' "
         'is not a GPU type Ray knows, so no n...'),
    Case("an accelerator_type Ray does not know, in args", FLEET,
         args(1, accelerator_type="H1000"),
         "applications[1].args.accelerator_type: accelerator_type 'H1000' is not a GPU type "
         "Ray knows; did you mean 'H100'? use on..."),
    Case("ray_actor_options that drop the variant's accelerator_type", FLEET,
         dep(1, ray_actor_options={"num_cpus": 4, "num_gpus": 1}),
         'applications[1].deployments[LLMReplica].ray_actor_options.accelerator_type: '
         "args.accelerator_type is H100, but these options (which replace the mesh's) do not "
         'ask for it, so Ray may place the replica on any GPU; set '
         'ray_actor_options.accelerator_type: H100'),
    Case("ray_actor_options that ask for another accelerator_type", FLEET,
         actor(1, accelerator_type="A100"),
         'applications[1].deployments[LLMReplica].ray_actor_options.accelerator_type: '
         'args.accelerator_type is H100, but these options ask for A100; set '
         'ray_actor_options.accelerator_type: H100'),
    Case("an accelerator_type on a replica with no GPU", FLEET,
         dep(1, ray_actor_options={"num_cpus": 4, "accelerator_type": "H100"}),
         'applications[1].args.accelerator_type: the replica holds no GPU, and an accelerator '
         "type is a GPU's; give it one (ray_actor_options: {{num_cpus: 2, num_gpus: 1, "
         "accelerator_type: H100}}, or remove ray_actor_options to take the mesh's) or remove "
         'the accelerator type', count=2),
    Case("more CPUs for a TP replica's actor than its first bundle holds", FLEET,
         dep(2, ray_actor_options={"num_cpus": 8}),
         'applications[2].deployments[LLMReplica].ray_actor_options.num_cpus: the replica '
         "actor asks for CPU 8, over the CPU 3 of the first bundle of the mesh's placement "
         "group, built for the mesh's own actor options {{num_cpus..."),
    Case("memory for a TP replica's actor its first bundle does not hold", FLEET,
         dep(2, ray_actor_options={"num_cpus": 1, "memory": 68719476736}),
         'applications[2].deployments[LLMReplica].ray_actor_options.memory: the replica actor '
         'asks for memory 68719476736 bytes (64 GiB), over the memory 18253611008 bytes (17 '
         "GiB) of the first bundle of the mesh's placement group, built for the mesh's own "
         'actor options {{num_cpus...'),
    Case("a GPU for a TP replica's actor", FLEET,
         dep(2, ray_actor_options={"num_cpus": 1, "num_gpus": 1}),
         'applications[2].deployments[LLMReplica]: tensor_parallel_size x '
         'pipeline_parallel_size = 2: the engine spans 2 GPUs, and the replica is granted 1 '
         '(2 GPU(s) in its placement_group_bundles, less the 1 its actor takes '
         '(ray_actor_options.num_gpus)). The mesh gives a replica that spans GPUs a placement '
         'group of one GPU bundle each (docs/gpu-fleet.md): leave num_gpus out of its '
         'ray_actor_options and placement_group_bundles out of the deployment, or lower the '
         'parallel sizes'),
    Case("a bundle's GPU as a string", FLEET,
         dep(2, placement_group_bundles=[{**B[0], "GPU": "1"}, B[1]]),
         "applications[2].deployments[LLMReplica].placement_group_bundles[0].GPU: got '1' (a "
         'string); write the number without quotes, e.g. GPU: 1'),
    Case("an empty bundle", FLEET, dep(2, placement_group_bundles=[{}, B[1]]),
         'applications[2].deployments[LLMReplica].placement_group_bundles[0]: got {{}}; a '
         'bundle is a mapping of Ray resources to quantities, e.g. {{GPU: 1, CPU: 1}}'),
    Case("two GPUs in one bundle for two workers", FLEET,
         dep(2, placement_group_bundles=[{**B[0], "GPU": 2}]),
         'applications[2].deployments[LLMReplica]: tensor_parallel_size x '
         'pipeline_parallel_size = 2: the engine spans 2 GPUs, and the replica is granted 1 '
         '(2 GPU(s) in its placement_group_bundles; 1 bundle(s) with a whole GPU free, and '
         'vLLM runs one worker on one GPU in each). The mesh gives a replica that spans GPUs '
         'a placement group of one GPU bundle each (docs/gpu-fleet.md): leave num_gpus out of '
         'its ray_actor_options and placement_group_bundles out of the deployment, or lower '
         'the parallel sizes'),
    Case("bundles that do not ask for the variant's accelerator", FLEET,
         dep(2, placement_group_bundles=[{"GPU": 1, "CPU": 3, "memory": 17 * GiB},
                                         {"GPU": 1, "CPU": 1, "memory": 13 * GiB}]),
         'applications[2].deployments[LLMReplica].placement_group_bundles[0]: '
         'args.accelerator_type is H100, but this GPU bundle does not ask for '
         "'accelerator_type:H100', so Ray may place it on any GPU; add "
         "'accelerator_type:H100': 0.001 to it, as the mesh's bundles do", count=2),
    Case("a first bundle with no CPU for the actor", FLEET,
         dep(2, placement_group_bundles=[{"GPU": 1, "accelerator_type:H100": 0.001}, B[1]]),
         'applications[2].deployments[LLMReplica].placement_group_bundles[0]: the first '
         'bundle holds CPU 0, and the replica actor, which Serve places there, asks for CPU 1 '
         "(the mesh's ray_actor_options {{num_cpus: 1}}); add it to the first bundle, or set "
         'ray_actor_options (docs/gpu-fleet.md, "Pod sizing")'),
    Case("a placement strategy Ray does not know", FLEET,
         dep(2, placement_group_strategy="PACKED"),
         "applications[2].deployments[LLMReplica].placement_group_strategy: got 'PACKED'; "
         "Ray's strategies are PACK, SPREAD, STRICT_PACK, STRICT_SPREAD (PACK..."),
    Case("a tensor_parallel_size of 0", FLEET, engine(2, tensor_parallel_size=0),
         'applications[2].args.engine_args: engine_args.tensor_parallel_size must be a whole '
         'number >= 1, got 0'),
    Case("a tensor_parallel_size as a string", FLEET, engine(2, tensor_parallel_size="2"),
         'applications[2].args.engine_args: engine_args.tensor_parallel_size must be a whole '
         "number >= 1, got '2'"),
    Case("a fractional tensor_parallel_size", FLEET, engine(2, tensor_parallel_size=2.5),
         'applications[2].args.engine_args: engine_args.tensor_parallel_size must be a whole '
         'number >= 1, got 2.5'),
    Case("a negative pipeline_parallel_size", FLEET, engine(2, pipeline_parallel_size=-1),
         'applications[2].args.engine_args: engine_args.pipeline_parallel_size must be a '
         'whole number >= 1, got -1'),
    Case("a TP replica on the multiprocessing executor", FLEET,
         engine(2, distributed_executor_backend="mp"),
         "applications[2].args: engine_args.distributed_executor_backend 'mp': a replica that "
         "spans 2 GPUs (tensor_parallel_size x pipeline_parallel_size) runs vLLM's workers in "
         "its Ray placement group: use 'ray' (the default then)"),

]
