#!/usr/bin/env bash
# The main job: serve the embedded model through the mesh and show real answers.
#   1. set up (venv, packages, embedded model)    2. start Ray (if not running)
#   3. serve deploy serve_configs/local.yaml      4. wait until RUNNING
#   5. send real chat requests with the openai client (one streamed)
# The mesh keeps running on http://127.0.0.1:8000 afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }

CONFIG=${1:-serve_configs/local.yaml}
./scripts/setup.sh
source .venv/bin/activate
# A loopback-only local cluster; clusters reachable from a network keep Ray's token auth.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# Ray Serve's throughput settings (serve_app/common/serve_env.py), read by `ray start`.
eval "$(python -m serve_app.common.serve_env)"

if ray status >/dev/null 2>&1; then
  say "Ray is already running"
else
  say "starting Ray (head node, dashboard on 127.0.0.1:8265)"
  ray start --head --num-cpus 2 --dashboard-host 127.0.0.1 --disable-usage-stats >/dev/null
fi

meshctl validate "$CONFIG"
say "serve deploy $CONFIG"
serve deploy "$CONFIG"
say "waiting for the applications to be RUNNING (the vLLM engine takes ~30-60 s to start)"
meshctl wait "$CONFIG"

# Every shipped config with tenants has the admin demo tenant `ops`; open mode ignores keys.
python scripts/demo_requests.py --base-url http://127.0.0.1:8000/v1 \
  --api-key "${MESH_API_KEY:-sk-mesh-ops-demo}"

say "the mesh is running on http://127.0.0.1:8000 (OpenAI API under /v1)"
say "try:  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\"
say "        -d '{\"model\": \"smollm\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}]}'"
say "stop: source .venv/bin/activate && serve shutdown -y && ray stop"
