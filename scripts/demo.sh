#!/usr/bin/env bash
# The main job: serve the embedded model through the mesh and show real answers.
#   ./scripts/demo.sh [CONFIG]     CONFIG: a Serve config (default serve_configs/local.yaml)
#   1. set up (venv, packages, embedded model)    2. start Ray (if not running): dashboard
#      127.0.0.1:8265, metrics export port 8080 (what meshctl top-adapters and Prometheus read)
#   3. meshctl validate, serve deploy CONFIG      4. wait until RUNNING
#   5. send real chat requests with the openai client (one streamed)
# The mesh keeps running on http://127.0.0.1:8000 afterwards; ./scripts/stop.sh stops it all.
# Environment [default]: MESH_API_KEY, the key of the demo requests [sk-mesh-ops-demo];
# RAY_AUTH_MODE [disabled: a loopback-only cluster].
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }

CONFIG=${1:-serve_configs/local.yaml}
[ -f "$CONFIG" ] || { echo "demo.sh: no config file $CONFIG (see ./scripts/demo.sh --help)" >&2; exit 2; }
./scripts/setup.sh
source .venv/bin/activate
# A loopback-only local cluster; clusters reachable from a network keep Ray's token auth.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# Ray Serve's throughput settings (serve_app/common/serve_env.py), read by `ray start`.
eval "$(python -m serve_app.common.serve_env)"

if ray status >/dev/null 2>&1; then
  say "Ray is already running (meshctl top-adapters reads metrics on :8080 only if it was started with --metrics-export-port=8080)"
else
  say "starting Ray (head node, dashboard on 127.0.0.1:8265, metrics on :8080)"
  # The metrics port is pinned: meshctl top-adapters reads http://127.0.0.1:8080/metrics.
  ray start --head --num-cpus 2 --dashboard-host 127.0.0.1 --metrics-export-port=8080 \
    --disable-usage-stats >/dev/null
fi

meshctl validate "$CONFIG"
say "serve deploy $CONFIG"
serve deploy "$CONFIG"
say "waiting for the applications to be RUNNING (a variant's replica takes ~75 s to start here)"
meshctl wait "$CONFIG"

# Every shipped config with tenants has the admin demo tenant `ops`; open mode ignores keys.
python scripts/demo_requests.py --base-url http://127.0.0.1:8000/v1 \
  --api-key "${MESH_API_KEY:-sk-mesh-ops-demo}"

say "the mesh is running on http://127.0.0.1:8000 (OpenAI API under /v1)"
say "try:  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\"
say "        -d '{\"model\": \"smollm\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}]}'"
say "stop everything (Serve, Ray, the counts actor, Prometheus): ./scripts/stop.sh"
