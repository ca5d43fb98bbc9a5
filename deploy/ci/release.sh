#!/usr/bin/env bash
# Release one Serve config of the mesh, as CI does (deploy/ci/github-actions.yml calls this):
#   1. meshctl validate CONFIG --against live   refuse a bad config, or one restarting replicas
#   2. meshctl diff live CONFIG                 print what changes, in place or by restart
#   3. meshctl deploy CONFIG                    serve deploy, then wait until every application
#                                               runs the new config (RUNNING)
#   4. meshctl rollout status --watch --config  if CONFIG declares a `rollout:`: print each
#        --timeout S --report DIR               decision until promote / rollback / abort,
#                                               then write the rollout report into DIR
#   deploy/ci/release.sh CONFIG
#
# Environment [default]:
#   RAY_DASHBOARD_ADDRESS   the Ray dashboard (serve deploy, live config) [http://127.0.0.1:8265]
#   MESH_ROUTER_URL         the mesh's HTTP address (/admin/rollouts) [http://127.0.0.1:8000]
#   MESH_ADMIN_KEY          an admin tenant's API key (step 4)
#   MESH_ROLLOUT_TIMEOUT_S  longest wait for the rollout's verdict, s [3600]
#   MESH_DEPLOY_TIMEOUT_S   longest wait for RUNNING, s [900]
#   MESH_REPORT_DIR         where the rollout report goes [out]
#   MESH_PROMETHEUS         Prometheus for the report's plots, empty: none [http://127.0.0.1:9090]
#   MESH_SPLIT              the rollout's split key, when the config has several [the only one]
#   MESH_ALLOW_RESTART      1: accept changes that restart replicas in step 1 [0]
#   MESHCTL                 the meshctl to run [this repo's .venv/bin/meshctl, else PATH's]
#
# Exit status: 0 when deployed (and its rollout, if any, promoted); else the failed step's:
# 1 (invalid config, a restart refused, deploy failed or timed out, usage: meshctl's 2 for a
# file it cannot read or a dashboard it cannot reach is 1 here), or from step 4:
# 2 rolled back, 3 aborted, 4 timeout, 5 mesh unreachable (docs/ci.md).
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
[ $# -eq 1 ] || { sed -n '2,10p' "$0" >&2; exit 1; }
CONFIG=$1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -x "$ROOT/.venv/bin/meshctl" ] && DEFAULT_MESHCTL=$ROOT/.venv/bin/meshctl || DEFAULT_MESHCTL=meshctl
MESHCTL=${MESHCTL:-$DEFAULT_MESHCTL}
ALLOW_RESTART=$( [ "${MESH_ALLOW_RESTART:-0}" = 1 ] && echo --allow-restart || true )
export RAY_DASHBOARD_ADDRESS=${RAY_DASHBOARD_ADDRESS:-http://127.0.0.1:8265}
export MESH_ROUTER_URL=${MESH_ROUTER_URL:-http://127.0.0.1:8000}
step() { printf '\n\033[1m[release] %s\033[0m\n' "$*"; }

step "1/4 validate $CONFIG against the live config"
"$MESHCTL" validate "$CONFIG" --against live $ALLOW_RESTART || exit 1

step "2/4 what changes"
"$MESHCTL" diff live "$CONFIG" --skip-engine-check || exit 1   # step 1 ran vLLM's checks

step "3/4 serve deploy, wait until RUNNING"
"$MESHCTL" deploy "$CONFIG" --skip-engine-check --timeout-s "${MESH_DEPLOY_TIMEOUT_S:-900}" || exit 1

if ! grep -Eq '^[[:space:]]+rollout:' "$CONFIG"; then
  step "4/4 no rollout in $CONFIG: released"
  exit 0
fi
step "4/4 follow the rollout until its verdict"
exec "$MESHCTL" rollout status --watch --config "$CONFIG" --timeout "${MESH_ROLLOUT_TIMEOUT_S:-3600}" \
  --report "${MESH_REPORT_DIR:-out}" --prometheus "${MESH_PROMETHEUS-http://127.0.0.1:9090}" \
  ${MESH_SPLIT:+--split "$MESH_SPLIT"}
