#!/usr/bin/env bash
# GPU smoke run: a GPU host's first day, end to end, in at most 8 minutes after set-up
# (docs/gpu-fleet.md). Its steps, in order:
#   driver    the NVIDIA driver against the GPU lock (scripts/check_driver.sh), before anything
#             is installed: one line naming the fixes when it is too old
#   setup     MESH_ACCEL=gpu ./scripts/setup.sh (the GPU lock, the embedded model), bounded by
#             SMOKE_SETUP_S; the budget (SMOKE_BUDGET_S) starts when it ends
#   hub       a local hub (tests/support/hub_server.py on 127.0.0.1) serving the embedded model
#             as mesh-smoke/smollm2-135m-instruct at a commit; the variants pin the commit it
#             reports, and their replicas fetch the model over the hub's protocol (HF_ENDPOINT)
#             into a fresh hub cache
#   configs   two variants (smollm-v1, smollm-v2: bf16, CUDA graphs, 0.4 GPU each) with
#             acme-support@v1, then the same with acme-support@v2 (a registered copy of
#             globex-report's weights); with 2+ GPUs a variant of tensor_parallel_size 2
#   validate  meshctl validate every config; meshctl diff: the adapter swap is in place
#   deploy    Ray; smollm-v1 alone, then smollm-v2 beside it at 90/10 (one engine starts at a
#             time: vLLM sizes its KV cache from the GPU memory free while it starts)
#   canary    100 callers of smollm:acme-support: each on the variant the sticky 90/10 split
#             picks for it, smollm-v2 within 3 sigma of 10 %, every answer 200 from acme-support@v1
#   swap      acme-support v1 -> v2 in place under load (SMOKE_LOAD_S s of requests): no request
#             fails, no replica restarts, then acme-support@v2 answers
#   bench     scripts/bench.py: the mesh against vLLM's own server on this GPU, same model
#   tp        with 2+ GPUs: the mesh stopped, then a replica of tensor_parallel_size 2 (a small
#             random-weight Llama: the embedded model's 9 attention heads do not split in two)
#             on a placement group of two GPU bundles, answering through the mesh
# Every exit past the arguments writes OUT, one JSON: status (ok, failed or dry-run), the
# reason and step of a failure, seconds since set-up, and every figure gathered so far; then
# stops what the run started. Every wait is bounded by what is left of the budget.
# Usage: ./scripts/gpu_smoke.sh [--dry-run] [OUT]
#   OUT        the JSON [$TMPDIR/gpu-smoke.json, TMPDIR defaulting to /tmp]; a relative path
#              is taken from the current directory
#   --dry-run  no GPU, no driver check, no install, no Ray: the hub (the model fetched from it
#              here), the configs, meshctl validate and diff, and the JSON (status dry-run)
# Environment [default]: SMOKE_WORKDIR [a new temporary folder]; SMOKE_EAGER [0: CUDA graphs;
# 1: enforce_eager]; SMOKE_LOAD_S [40: seconds of load around the swap]; SMOKE_BUDGET_S [480];
# SMOKE_SETUP_S [1800]; SMOKE_FAIL_AT [none; a step's name: fail it on purpose, to see the
# JSON of a failed run]; MESH_SKIP_DRIVER_CHECK [0]; RAY_AUTH_MODE [disabled: a loopback-only
# cluster].
set -Eeuo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
say() { printf '\033[1m[gpu-smoke]\033[0m %s\n' "$*"; }
usage_error() { echo "gpu_smoke.sh: $* (see ./scripts/gpu_smoke.sh --help)" >&2; exit 2; }
DRY=0
if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
case "${1:-}" in -*) usage_error "unknown option '$1'";; esac
[ $# -le 1 ] || usage_error "one OUT at most, not '$*'"
for var in SMOKE_LOAD_S SMOKE_BUDGET_S SMOKE_SETUP_S; do
  [[ ${!var:-1} =~ ^[0-9]+$ ]] || usage_error "$var must be a whole number of seconds, not '${!var}'"
done
[[ ${SMOKE_EAGER:-0} =~ ^[01]$ ]] || usage_error "SMOKE_EAGER must be 0 or 1, not '$SMOKE_EAGER'"
# OUT and SMOKE_WORKDIR are the caller's paths: resolved before the cd below.
OUT=$(realpath -m -- "${1:-${TMPDIR:-/tmp}/gpu-smoke.json}")
WORK=$(realpath -m -- "${SMOKE_WORKDIR:-$(mktemp -d -t gpu-smoke.XXXXXX)}")
cd "$(dirname "$0")/.."
REPO=$PWD
EAGER=${SMOKE_EAGER:-0}
LOAD_S=${SMOKE_LOAD_S:-40}
BUDGET_S=${SMOKE_BUDGET_S:-480}
SETUP_S=${SMOKE_SETUP_S:-1800}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
PY=$REPO/.venv/bin/python
mkdir -p "$WORK" "$(dirname "$OUT")"
: > "$WORK/steps.tsv"

STATUS=failed REASON='' STEP=start SETUP_TOOK='' HUB_PID='' RAY_STARTED=0
t0=$SECONDS  # the budget's start: reset when set-up ends

left() { echo $((BUDGET_S - (SECONDS - t0))); }
fail() { REASON="$*"; echo "gpu_smoke.sh: $*" >&2; exit 1; }

step() {  # step NAME WHAT: log it; refuse it when the budget is spent or SMOKE_FAIL_AT names it
  STEP=$1
  printf '%s\t%s\n' "$1" "$((SECONDS - t0))" >> "$WORK/steps.tsv"
  say "$1: $2 ($((SECONDS - t0)) s of ${BUDGET_S} s)"
  [ "$(left)" -gt 0 ] || fail "over the ${BUDGET_S} s budget before step '$1'"
  if [ "${SMOKE_FAIL_AT:-}" = "$1" ]; then
    REASON="step '$1' failed on purpose (SMOKE_FAIL_AT=$1)"
    echo "gpu_smoke.sh: $REASON" >&2
    return 1
  fi
}

bounded() {  # bounded CMD...: CMD, stopped (with what it started) when the budget runs out
  local rc=0 limit
  limit=$(left)
  [ "$limit" -gt 0 ] || fail "over the ${BUDGET_S} s budget in step '$STEP'"
  timeout -k 10 "$limit" "$@" || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    fail "step '$STEP' ran past the ${BUDGET_S} s budget: ${1##*/} stopped after $limit s"
  fi
  return "$rc"
}

on_err() {  # the first failure's reason, unless a step gave its own
  local rc=$?
  [ -n "$REASON" ] || REASON="step '$STEP': '$BASH_COMMAND' exited $rc"
}

write_json() {  # OUT from what the steps left in WORK; any Python will do (set-up may not be done)
  local py
  for py in "$PY" python3; do
    command -v "$py" >/dev/null || continue
    "$py" - "$WORK" "$OUT" "$STATUS" "$REASON" "$STEP" "$DRY" "$((SECONDS - t0))" \
        "$SETUP_TOOK" "$BUDGET_S" <<'EOF' && return 0
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
status, reason, step, dry, seconds, setup_s, budget = sys.argv[3:10]
def read(name):
    try:
        return json.loads((work / name).read_text())
    except (OSError, ValueError):
        return None
def lines(name):
    p = work / name
    return p.read_text().strip().splitlines() if p.exists() else None
hub = read("hub.json")
if hub is not None:
    hub["file_gets"] = read("hub-requests.json")
out.write_text(json.dumps({
    "status": status, "reason": reason or None, "step": step, "dry_run": dry == "1",
    "setup_s": int(setup_s) if setup_s else None, "seconds": int(seconds),
    "budget_s": int(budget), "within_budget": int(seconds) <= int(budget),
    "steps": [{"step": s, "at_s": int(t)} for s, t in
              (line.split("\t") for line in lines("steps.tsv") or [])],
    "driver": (lines("driver.txt") or [None])[-1], "gpus": lines("gpu.txt"), "hub": hub,
    "configs": {p.stem: str(p) for p in sorted(work.glob("serve-*.yaml"))},
    "canary": read("canary.json"), "swap_under_load": read("swap.json"),
    "bench": read("bench.json"), "tensor_parallel": read("tp.json")}, indent=1) + "\n")
print(f"[gpu-smoke] {status}: figures in {out}")
EOF
  done
  printf '{"status": "%s", "step": "%s", "reason": "no Python to write the figures"}\n' \
    "$STATUS" "$STEP" > "$OUT"
}

cleanup() {
  if [ -n "$HUB_PID" ]; then kill "$HUB_PID" 2>/dev/null || true; fi
  if [ "$RAY_STARTED" = 1 ]; then timeout -k 10 120 ./scripts/stop.sh >/dev/null 2>&1 || true; fi
}

finish() {
  local rc=$?
  trap - ERR
  set +e
  if [ "$rc" != 0 ]; then
    STATUS=failed
    [ -n "$REASON" ] || REASON="exit $rc in step '$STEP'"
  fi
  write_json
  cleanup
  exit "$rc"
}
trap on_err ERR
trap finish EXIT
trap 'REASON="interrupted (SIGINT) in step $STEP"; exit 130' INT
trap 'REASON="stopped (SIGTERM) in step $STEP"; exit 143' TERM

if [ "$DRY" = 0 ]; then
  step driver "the NVIDIA driver against requirements-gpu.txt (scripts/check_driver.sh)"
  rc=0
  ./scripts/check_driver.sh requirements-gpu.txt > "$WORK/driver.txt" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    REASON=$(tail -n1 "$WORK/driver.txt")
    cat "$WORK/driver.txt" >&2
    [ "$rc" != 2 ] || echo "gpu_smoke.sh: ./scripts/gpu_smoke.sh --dry-run checks what a" \
      "host without a GPU can" >&2
    exit "$rc"
  fi
  cat "$WORK/driver.txt"
  timeout 60 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    > "$WORK/gpu.txt"
  step setup "MESH_ACCEL=gpu ./scripts/setup.sh (at most $SETUP_S s; the budget starts after it)"
  rc=0 s0=$SECONDS
  MESH_ACCEL=gpu timeout -k 10 "$SETUP_S" ./scripts/setup.sh || rc=$?
  SETUP_TOOK=$((SECONDS - s0))
  [ "$rc" = 0 ] || fail "set-up (MESH_ACCEL=gpu ./scripts/setup.sh) exited $rc after" \
    "$SETUP_TOOK s$([ "$rc" != 124 ] || echo ": past SMOKE_SETUP_S=$SETUP_S")"
  t0=$SECONDS
fi
[ -x "$PY" ] || fail "no $PY: run ./scripts/setup.sh first"
GPUS=0
[ ! -s "$WORK/gpu.txt" ] || GPUS=$(wc -l < "$WORK/gpu.txt")

step hub "a local hub serving the embedded model on 127.0.0.1"
"$PY" - "$WORK" > "$WORK/hub.log" 2>&1 <<'EOF' &
import hashlib, json, os, signal, sys, time, urllib.request
from pathlib import Path
from serve_app.common.paths import DEFAULT_MODEL_NAME, models_dir
from tests.support.hub_server import HubServer
work, repo = Path(sys.argv[1]), f"mesh-smoke/{DEFAULT_MODEL_NAME}"
folder = models_dir() / DEFAULT_MODEL_NAME
# The commit names the folder's content, as a git commit does: the same files, the same commit.
hub = HubServer({repo: ("0" * 40, folder)})
tree = hub.files(repo)
commit = hashlib.sha1(json.dumps([(f["path"], f["oid"]) for f in tree]).encode()).hexdigest()
hub.repos[repo] = (commit, folder)
hub.start()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
head = urllib.request.Request(f"{hub.url}/{repo}/resolve/{commit}/config.json", method="HEAD")
with urllib.request.urlopen(head, timeout=10) as r:
    reported = r.headers["X-Repo-Commit"]  # the revision the hub reports: what configs pin
ready = work / "hub.json.partial"
ready.write_text(json.dumps({"url": hub.url, "repo": repo, "commit": reported,
                             "files": len(tree), "bytes": sum(f["size"] for f in tree)}))
os.replace(ready, work / "hub.json")
seen = None
while True:  # the GETs of each file, as the replicas fetch
    if dict(hub.requests) != seen:
        seen = dict(hub.requests)
        (work / "hub-requests.json.partial").write_text(json.dumps(seen))
        os.replace(work / "hub-requests.json.partial", work / "hub-requests.json")
    time.sleep(1)
EOF
HUB_PID=$!
# shellcheck disable=SC2016  # $1 and $2 are the inner shell's
bounded bash -c 'until [ -s "$1" ]; do kill -0 "$2" 2>/dev/null || exit 3; sleep 0.2; done' \
  wait-for-hub "$WORK/hub.json" "$HUB_PID" \
  || fail "the local hub did not start: $(tail -n1 "$WORK/hub.log")"
HUB_URL=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["url"])' "$WORK/hub.json")
export HF_ENDPOINT=$HUB_URL HF_HOME=$WORK/hf MESH_CACHE_DIR=$WORK/cache
if [ "$DRY" = 1 ]; then  # no replica fetches in a dry run: fetch it here, as a replica would
  bounded "$PY" -c 'import json, sys
from serve_app.common.fetch import fetch_model
hub = json.load(open(sys.argv[1]))
print("[gpu-smoke] fetched from the local hub into", fetch_model(hub["repo"], hub["commit"]))
' "$WORK/hub.json"
fi

step configs "the smoke's Serve configs and adapter manifest in $WORK"
TP=0  # the TP 2 variant: where it can run, and in a dry run (to validate it)
if [ "$DRY" = 1 ] || [ "$GPUS" -ge 2 ]; then TP=1; fi
bounded "$PY" - "$WORK" "$EAGER" "$TP" <<'EOF'
import copy, json, shutil, sys
from pathlib import Path
import yaml
from serve_app.common.adapters import load_manifest
from serve_app.common.paths import DEFAULT_MODEL_NAME, REPO_ROOT, models_dir
from serve_app.common.serve_configs import load_yaml

work, eager, tp = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
hub = json.loads((work / "hub.json").read_text())
env = {"HF_ENDPOINT": hub["url"], "HF_HOME": str(work / "hf"),
       "MESH_CACHE_DIR": str(work / "cache")}
demo = load_manifest()
acme, globex = demo["acme-support@v1"], demo["globex-report@v1"]
entries = [{**acme.model_dump(), "uri": str(REPO_ROOT / acme.uri)},
           {**globex.model_dump(), "name": "acme-support", "version": 2,
            "uri": str(REPO_ROOT / globex.uri)}]
for e in entries:  # the variants' model is the hub's copy of the one they were trained on
    e.update(base_model=hub["repo"], base_model_revision=hub["commit"])
(work / "manifest.yaml").write_text(yaml.safe_dump({"adapters": entries}, sort_keys=False))


def write(name, cfg):
    (work / name).write_text(yaml.safe_dump(cfg, sort_keys=False))


def routes(cfg):
    return cfg["applications"][0]["deployments"][0]["user_config"]["routes"]


cfg = load_yaml(REPO_ROOT / "serve_configs" / "local.yaml")
variant = cfg["applications"][1]
variant["runtime_env"] = {"env_vars": env}  # the CPU-only variables do not apply on a GPU
variant["args"].update(model=hub["repo"], revision=hub["commit"])
variant["args"]["engine_args"].update(dtype="bfloat16", enforce_eager=eager,
                                      gpu_memory_utilization=0.3, max_num_seqs=32)
variant["deployments"][0].update(
    ray_actor_options={"num_cpus": 1, "num_gpus": 0.4},  # two variants share the GPU
    user_config={"adapters": [{"name": "acme-support", "version": 1}],
                 "adapters_manifest": str(work / "manifest.yaml")})
write("serve-v0.yaml", cfg)  # the stable variant alone: its engine starts first
v2app = copy.deepcopy(variant)
v2app["name"] = "smollm-v2"
cfg["applications"].append(v2app)
routes(cfg)["smollm"]["variants"] = [
    {"application": "smollm-v1", "weight": 90}, {"application": "smollm-v2", "weight": 10}]
write("serve-v1.yaml", cfg)
for app in cfg["applications"][1:]:  # the in-place swap: v1 -> v2 of acme-support
    app["deployments"][0]["user_config"]["adapters"] = [{"name": "acme-support", "version": 2}]
write("serve-v2.yaml", cfg)

if tp:  # a model whose 8 heads split across 2 GPUs, with the embedded model's tokenizer
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src, tiny = models_dir() / DEFAULT_MODEL_NAME, work / "models" / "tiny-llama-tp2"
    base = json.loads((src / "config.json").read_text())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=512, intermediate_size=1024,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=base["bos_token_id"], eos_token_id=base["eos_token_id"],
        pad_token_id=base.get("pad_token_id"))).to(torch.bfloat16)
    model.save_pretrained(tiny, safe_serialization=True)
    for f in src.iterdir():  # the tokenizer, its chat template, the generation defaults
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "mesh_model_stamp.json"):
            shutil.copy(f, tiny / f.name)
    tp_cfg = copy.deepcopy(cfg)
    tp_app = {"name": "tiny-tp2", "route_prefix": None,
              "import_path": "serve_app.replica:build_app",
              "args": {"model": str(tiny), "served_model_name": "tiny",
                       "engine_args": {"dtype": "bfloat16", "enforce_eager": eager,
                                       "tensor_parallel_size": 2, "max_model_len": 2048,
                                       "gpu_memory_utilization": 0.3, "max_num_seqs": 8}},
              "deployments": [{"name": "LLMReplica", "num_replicas": 1,
                               "user_config": {}}]}
    tp_cfg["applications"] = [tp_cfg["applications"][0], tp_app]
    routes(tp_cfg).clear()
    routes(tp_cfg)["tiny"] = {"variants": [{"application": "tiny-tp2", "weight": 100}]}
    write("serve-tp.yaml", tp_cfg)
print("[gpu-smoke] wrote", ", ".join(sorted(p.name for p in work.glob("serve-*.yaml"))))
EOF

step validate "meshctl validate; meshctl diff: the canary's start and the swap are in place"
configs=("$WORK"/serve-*.yaml)
bounded .venv/bin/meshctl validate "${configs[@]}"
# no replica restarts: not when the canary joins (v0 -> v1), not when the adapter swaps
for pair in "serve-v0.yaml serve-v1.yaml" "serve-v1.yaml serve-v2.yaml"; do
  read -r old new <<<"$pair"
  bounded .venv/bin/meshctl diff --skip-engine-check --fail-on-restart "$WORK/$old" \
    "$WORK/$new" > "$WORK/diff.txt"
  cat "$WORK/diff.txt"
done

if [ "$DRY" = 1 ]; then
  STATUS=dry-run
  exit 0
fi

step deploy "Ray; smollm-v1, then smollm-v2 beside it at 90/10, with acme-support@v1"
# shellcheck source=/dev/null
source .venv/bin/activate
eval "$(python -m serve_app.common.serve_env)"
RAY_STARTED=1
bounded ray start --head --dashboard-host 127.0.0.1 --metrics-export-port=8080 \
  --disable-usage-stats >/dev/null
for config in serve-v0.yaml serve-v1.yaml; do
  bounded serve deploy "$WORK/$config"
  bounded meshctl wait --timeout-s "$(left)" "$WORK/$config"
done
COMMIT=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["commit"])' "$WORK/hub.json")
[ -f "$HF_HOME/hub/models--mesh-smoke--smollm2-135m-instruct/snapshots/$COMMIT/config.json" ] \
  || fail "the replicas started without fetching the model from the local hub into $HF_HOME"

step canary "100 callers of smollm:acme-support on the 90/10 split"
bounded python - "$WORK" <<'EOF'
import json, math, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import httpx
from serve_app.request.split import pick_variant

work, callers = Path(sys.argv[1]), [f"caller-{i}" for i in range(100)]
weighted = [("smollm-v1", 90), ("smollm-v2", 10)]
with httpx.Client(base_url="http://127.0.0.1:8000", timeout=60) as http, \
        ThreadPoolExecutor(8) as pool:
    rs = list(pool.map(lambda u: http.post("/v1/chat/completions", json={
        "model": "smollm:acme-support", "user": u, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Where is my order?"}]}), callers))
served = [r.headers.get("x-mesh-variant") for r in rs]
expected = [pick_variant(weighted, "smollm", u) for u in callers]
n_canary, bound = served.count("smollm-v2"), 3 * math.sqrt(len(callers) * 0.1 * 0.9)
summary = {"callers": len(callers), "statuses": sorted({r.status_code for r in rs}),
           "smollm-v2": n_canary, "expected_smollm-v2": expected.count("smollm-v2"),
           "off_split": sum(s != e for s, e in zip(served, expected)),
           "adapters": sorted({r.headers.get("x-mesh-adapter", "") for r in rs}),
           "replicas": sorted({r.headers.get("x-mesh-replica", "") for r in rs})}
(work / "canary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
problems = [p for p, bad in [
    ("a request did not answer 200", summary["statuses"] != [200]),
    ("a caller was not on the variant its sticky split picks", summary["off_split"]),
    (f"smollm-v2 got {n_canary} of 100 callers, not 10 +- {bound:.0f}",
     abs(n_canary - 10) > bound),
    ("an answer did not come from acme-support@v1", summary["adapters"] != ["acme-support@v1"]),
] if bad]
sys.exit("canary: " + "; ".join(problems) if problems else 0)
EOF

step swap "acme-support v1 -> v2 in place under load ($LOAD_S s of requests)"
bounded python - "$WORK" "$LOAD_S" <<'EOF'
import json, subprocess, sys, threading, time
from pathlib import Path
import httpx

work, load_s = Path(sys.argv[1]), float(sys.argv[2])
results, stop = [], threading.Event()


def ask(http, user):
    return http.post("/v1/chat/completions", json={
        "model": "smollm:acme-support", "user": user, "max_tokens": 32,
        "messages": [{"role": "user", "content": "Where is my order?"}]})


def worker(n):
    with httpx.Client(base_url="http://127.0.0.1:8000", timeout=120) as http:
        i = 0
        while not stop.is_set():
            t, i = time.monotonic(), i + 1
            try:
                r = ask(http, f"load-{n}-{i}")
                ok = r.status_code == 200
                results.append((t, "ok" if ok else "error",
                                r.json()["choices"][0]["message"]["content"] if ok
                                else f"{r.status_code}: {r.text[:200]}",
                                r.headers.get("x-mesh-adapter"), r.headers.get("x-mesh-replica")))
            except Exception as e:  # noqa: BLE001 -- counted: the swap must fail none
                results.append((t, "error", f"{type(e).__name__}: {e}"[:200], None, None))


threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
for th in threads:
    th.start()
time.sleep(load_s / 2)
swap_at = time.monotonic()
subprocess.run(["serve", "deploy", str(work / "serve-v2.yaml")], check=True)
time.sleep(load_s / 2)
stop.set()
for th in threads:
    th.join(120)
first_v2 = None
with httpx.Client(base_url="http://127.0.0.1:8000", timeout=60) as http:
    for i in range(60):  # until a fresh request is served by v2 (reconfigure() has run)
        r = ask(http, f"after-{i}")
        if r.headers.get("x-mesh-adapter") == "acme-support@v2":
            first_v2 = round(time.monotonic() - swap_at, 1)
            break
        time.sleep(1)
canary = json.loads((work / "canary.json").read_text())
before = [r for r in results if r[0] < swap_at]
after = [r for r in results if r[0] >= swap_at]
replicas_before = set(canary["replicas"]) | {r[4] for r in before if r[4]}
new_replicas = sorted({r[4] for r in after if r[4]} - replicas_before)
summary = {"requests": len(results), "errors": sum(r[1] == "error" for r in results),
           "error_samples": [r[2] for r in results if r[1] == "error"][:3],
           "adapters_before": sorted({r[3] for r in before if r[3]}),
           "adapters_after": sorted({r[3] for r in after if r[3]}),
           "v2_answers_after_s": first_v2, "new_replicas": new_replicas,
           "answers_before": [r[2] for r in before if r[1] == "ok"][-2:],
           "answers_after": [r[2] for r in after if r[1] == "ok" and r[3] and r[3].endswith("v2")][-2:]}
(work / "swap.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
problems = [p for p, bad in [
    ("no request ran", not results),
    (f"{summary['errors']} requests failed", summary["errors"]),
    (f"replicas {new_replicas} started: the swap was not in place", new_replicas),
    ("acme-support@v2 never answered", first_v2 is None)] if bad]
sys.exit("swap: " + "; ".join(problems) if problems else 0)
EOF

step bench "scripts/bench.py: the mesh and vLLM's own server on this GPU"
# vLLM's own server reads the model from the folder the replicas fetched it into.
bounded python - "$WORK" <<'EOF'
import sys
from pathlib import Path
import yaml
from serve_app.common.fetch import model_dir_here

work = Path(sys.argv[1])
cfg = yaml.safe_load((work / "serve-v2.yaml").read_text())
args = cfg["applications"][1]["args"]
args["model"] = model_dir_here(args["model"], args.pop("revision"))
if not args["engine_args"].get("enforce_eager"):  # vLLM's default: CUDA graphs
    args["engine_args"].pop("enforce_eager", None)
(work / "serve-bench.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
EOF
bounded python scripts/bench.py --config "$WORK/serve-bench.yaml" --variant smollm-v1 \
  --concurrency 1 8 32 --requests 64 --rounds 1 --max-tokens 64 --json "$WORK/bench.json"
bounded python -c 'import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
bad = [(r["concurrency"], side, r[side]["errors"]) for r in rows for side in ("mesh", "direct")
       if r[side]["errors"]]
sys.exit(f"bench: requests failed (concurrency, side, errors): {bad}" if bad else 0)
' "$WORK/bench.json"

if [ "$GPUS" -ge 2 ]; then
  step tp "the mesh stopped; a replica of tensor_parallel_size 2 on two GPUs"
  # One engine starting while another frees GPU memory breaks vLLM's memory profile: the
  # variants' engines are gone before the TP engine starts.
  # (nvidia-smi lists no processes inside most containers: the GPUs' memory says it.)
  bounded serve shutdown -y >/dev/null
  until nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits \
      | awk '$1 > 1024 {busy = 1} END {exit busy}'; do
    [ "$(left)" -gt 0 ] || fail "step 'tp' ran past the ${BUDGET_S} s budget: a GPU kept" \
      "over 1 GiB in use after serve shutdown"
    sleep 1
  done
  bounded serve deploy "$WORK/serve-tp.yaml"
  bounded meshctl wait --timeout-s "$(left)" "$WORK/serve-tp.yaml"
  bounded python - "$WORK" <<'EOF'
import json, subprocess, sys
from pathlib import Path
import httpx
import ray
from ray.util.state import list_placement_groups

work = Path(sys.argv[1])
with httpx.Client(base_url="http://127.0.0.1:8000", timeout=60) as http:
    statuses = [http.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 16,
        "messages": [{"role": "user", "content": f"Count to {i}."}]}).status_code
        for i in range(4)]
ray.init(address="auto", logging_level="ERROR")
groups = []
for pg in list_placement_groups(detail=True, filters=[("state", "=", "CREATED")]):
    bundles = [b.get("unit_resources") or b.get("unitResources") or {}
               for b in (pg.get("bundles") or [])]
    groups.append({"id": pg.get("placement_group_id"),
                   "gpu_bundles": sum(b.get("GPU", 0) >= 1 for b in bundles),
                   "bundles": bundles})
used_mib = [int(x) for x in subprocess.run(
    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
    capture_output=True, text=True, check=True).stdout.split()]
in_use = sum(m > 1024 for m in used_mib)  # an engine holds gpu_memory_utilization 0.3 of each
summary = {"statuses": statuses, "placement_groups": groups, "gpu_memory_used_mib": used_mib,
           "gpus_in_use": in_use}
(work / "tp.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
problems = [p for p, bad in [
    (f"statuses {statuses}", set(statuses) != {200}),
    ("no placement group of two GPU bundles", not any(g["gpu_bundles"] == 2 for g in groups)),
    (f"GPU memory in use on {in_use} GPU(s), not 2", in_use < 2)] if bad]
sys.exit("tp: " + "; ".join(problems) if problems else 0)
EOF
else
  echo '{"skipped": "one GPU: a replica of tensor_parallel_size 2 needs two"}' > "$WORK/tp.json"
fi

step finished "every step passed"
STATUS=ok
