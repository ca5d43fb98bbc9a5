#!/usr/bin/env bash
# Run a Redis server for the mesh's tenant ledger (the router's `ledger: {backend: redis,
# redis_url: redis://127.0.0.1:PORT/0}`), in the foreground, keeping its counts on disk
# (append-only file, fsync on every write) so that a restart gives no budget back.
#   ./scripts/redis_ledger.sh [PORT] [DATA_DIR]    defaults: 6379, .mesh/redis
# Installs Debian's redis-server first when it is missing (scripts/install_services.sh).
# In production, run Redis as you run your other stateful services (replicated, persistent).
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
PORT=${1:-6379}
DIR=${2:-.mesh/redis}
./scripts/install_services.sh
mkdir -p "$DIR"
echo "[redis] tenant ledger at redis://127.0.0.1:$PORT/0 (data in $DIR)"
exec redis-server --bind 127.0.0.1 --port "$PORT" --dir "$DIR" --appendonly yes \
  --appendfsync always --save ""
