#!/usr/bin/env bash
# GPU smoke run, one script, at most 8 minutes on one GPU (docs/gpu-fleet.md):
#   1. install the GPU lock (MESH_ACCEL=gpu ./scripts/setup.sh: vllm, CUDA torch)
#   2. serve the embedded model in bf16 on the GPU as two variants at 90/10 (smollm-v1,
#      smollm-v2: 0.4 GPU each), with one adapter (acme-support@v1)
#   3. swap the adapter in place under load (acme-support v1 -> v2, a registered copy of
#      globex-report's weights: the answers change style, no request may fail)
#   4. run scripts/bench.py against the mesh and vLLM's own server on the same GPU
#   5. write the figures to one JSON (OUT, default gpu-smoke.json), then stop the mesh
# Usage: ./scripts/gpu_smoke.sh [--dry-run] [OUT]
#   --dry-run   no GPU and no install: write the configs and the JSON's skeleton, check the
#               configs with meshctl validate (CPU hosts: engine-arg names only) and exit
# Environment [default]: SMOKE_WORKDIR [a new temporary folder]; SMOKE_EAGER [1: enforce_eager,
# the start within the budget; 0: CUDA graphs]; SMOKE_LOAD_S [40: seconds of load around the
# swap]; SMOKE_BUDGET_S [480]; RAY_AUTH_MODE [disabled: a loopback-only cluster].
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
say() { printf '\033[1m[gpu-smoke]\033[0m %s\n' "$*"; }
DRY=0
if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
case "${1:-}" in -*) echo "gpu_smoke.sh: unknown option '$1' (see ./scripts/gpu_smoke.sh --help)" >&2; exit 2;; esac
OUT=$(realpath -m "${1:-gpu-smoke.json}")
WORK=${SMOKE_WORKDIR:-$(mktemp -d -t gpu-smoke.XXXXXX)}
EAGER=${SMOKE_EAGER:-1}
LOAD_S=${SMOKE_LOAD_S:-40}
BUDGET_S=${SMOKE_BUDGET_S:-480}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
mkdir -p "$WORK"
t0=$SECONDS
step() {  # step NAME: log it, and stop when the budget is spent
  say "$1 ($((SECONDS - t0)) s of ${BUDGET_S} s)"
  if [ $((SECONDS - t0)) -gt "$BUDGET_S" ]; then
    echo "gpu_smoke.sh: over the ${BUDGET_S} s budget before '$1'" >&2
    exit 1
  fi
}

if [ "$DRY" = 0 ]; then
  step "installing the GPU lock (requirements-gpu.txt)"
  command -v nvidia-smi >/dev/null || { echo "gpu_smoke.sh: no nvidia-smi: not a GPU host (use --dry-run)" >&2; exit 2; }
  MESH_ACCEL=gpu ./scripts/setup.sh
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$WORK/gpu.txt"
fi
PY=.venv/bin/python

step "writing the smoke configs into $WORK"
"$PY" - "$WORK" "$EAGER" <<'EOF'
import copy, sys
from pathlib import Path
import yaml
from serve_app.common.adapters import load_manifest
from serve_app.common.paths import REPO_ROOT
from serve_app.common.serve_configs import load_yaml

work, eager = Path(sys.argv[1]), sys.argv[2] == "1"
demo = load_manifest()
acme, globex = demo["acme-support@v1"], demo["globex-report@v1"]
v2 = {**globex.model_dump(), "name": "acme-support", "version": 2,
      "uri": str(REPO_ROOT / globex.uri)}
(work / "manifest.yaml").write_text(yaml.safe_dump({"adapters": [
    {**acme.model_dump(), "uri": str(REPO_ROOT / acme.uri)}, v2]}, sort_keys=False))
cfg = load_yaml(REPO_ROOT / "serve_configs" / "local.yaml")
variant = cfg["applications"][1]
variant["runtime_env"] = {"env_vars": {}}  # the CPU-only variables do not apply on a GPU
variant["args"]["engine_args"].update(dtype="bfloat16", enforce_eager=eager,
                                      gpu_memory_utilization=0.3, max_num_seqs=32)
variant["deployments"][0].update(
    ray_actor_options={"num_cpus": 1, "num_gpus": 0.4},  # two variants share the GPU
    user_config={"adapters": [{"name": "acme-support", "version": 1}],
                 "adapters_manifest": str(work / "manifest.yaml")})
v2app = copy.deepcopy(variant)
v2app["name"] = "smollm-v2"
cfg["applications"].append(v2app)
cfg["applications"][0]["deployments"][0]["user_config"]["routes"]["smollm"]["variants"] = [
    {"application": "smollm-v1", "weight": 90}, {"application": "smollm-v2", "weight": 10}]
(work / "serve-v1.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
for app in cfg["applications"][1:]:  # the in-place swap: v1 -> v2 of acme-support
    app["deployments"][0]["user_config"]["adapters"] = [{"name": "acme-support", "version": 2}]
(work / "serve-v2.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
EOF
.venv/bin/meshctl validate "$WORK/serve-v1.yaml" "$WORK/serve-v2.yaml"
# the swap must be in place: no replica restarts
.venv/bin/meshctl diff --skip-engine-check --fail-on-restart "$WORK/serve-v1.yaml" \
  "$WORK/serve-v2.yaml" | tee "$WORK/diff.txt"

write_json() {  # write_json STATUS: gather what the steps left in $WORK into $OUT
  "$PY" - "$WORK" "$OUT" "$1" "$((SECONDS - t0))" "$DRY" <<'EOF'
import json, sys
from pathlib import Path
work, out, status, seconds, dry = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], \
    int(sys.argv[4]), sys.argv[5] == "1"
def read(name):
    p = work / name
    return json.loads(p.read_text()) if p.exists() else None
gpu = (work / "gpu.txt").read_text().strip() if (work / "gpu.txt").exists() else None
out.write_text(json.dumps({
    "status": status, "dry_run": dry, "seconds": seconds, "gpu": gpu,
    "configs": [str(work / "serve-v1.yaml"), str(work / "serve-v2.yaml")],
    "swap_under_load": read("swap.json"), "bench": read("bench.json")}, indent=1) + "\n")
print(f"[gpu-smoke] figures in {out}")
EOF
}

if [ "$DRY" = 1 ]; then
  write_json dry-run
  exit 0
fi

cleanup() { ./scripts/stop.sh >/dev/null 2>&1 || true; }
trap 'write_json failed; cleanup' ERR
trap cleanup EXIT

step "starting Ray and deploying two variants at 90/10 with acme-support@v1"
# shellcheck source=/dev/null
source .venv/bin/activate
eval "$(python -m serve_app.common.serve_env)"
ray start --head --dashboard-host 127.0.0.1 --metrics-export-port=8080 --disable-usage-stats >/dev/null
serve deploy "$WORK/serve-v1.yaml"
meshctl wait "$WORK/serve-v1.yaml"

step "swapping the adapter in place under load ($LOAD_S s of requests)"
python - "$WORK" "$LOAD_S" <<'EOF'
import json, subprocess, sys, threading, time
from pathlib import Path
import openai
work, load_s = Path(sys.argv[1]), float(sys.argv[2])
client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none", max_retries=0)
results, stop = [], threading.Event()
def worker():
    while not stop.is_set():
        t = time.monotonic()
        try:
            r = client.chat.completions.create(model="smollm:acme-support", max_tokens=32,
                messages=[{"role": "user", "content": "Where is my order?"}])
            results.append((t, "ok", r.choices[0].message.content))
        except Exception as e:  # noqa: BLE001 -- counted: the swap must fail none
            results.append((t, "error", f"{type(e).__name__}: {e}"[:200]))
threads = [threading.Thread(target=worker) for _ in range(8)]
for th in threads:
    th.start()
time.sleep(load_s / 2)
swap_at = time.monotonic()
subprocess.run(["serve", "deploy", str(work / "serve-v2.yaml")], check=True)
time.sleep(load_s / 2)
stop.set()
for th in threads:
    th.join(120)
before = [r for r in results if r[0] < swap_at]
after = [r for r in results if r[0] >= swap_at + 10]
summary = {"requests": len(results), "errors": sum(r[1] == "error" for r in results),
           "error_samples": [r[2] for r in results if r[1] == "error"][:3],
           "answers_before": [r[2] for r in before[-2:]],
           "answers_after": [r[2] for r in after[-2:]]}
(work / "swap.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF

step "bench.py: the mesh and vLLM's own server on this GPU"
python scripts/bench.py --config "$WORK/serve-v2.yaml" --variant smollm-v1 \
  --concurrency 1 8 32 --requests 64 --rounds 1 --max-tokens 64 --json "$WORK/bench.json"

step "done"
write_json ok
