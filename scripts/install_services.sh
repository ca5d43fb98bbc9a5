#!/usr/bin/env bash
# Install the Debian packages of the real servers the mesh's scripts and tests run, when
# their binaries are missing: prometheus (scripts/observability.sh, tests/integration/test_observability.py)
# and redis-server (the redis tenant ledger: scripts/redis_ledger.sh,
# tests/unit/tenancy/test_ledger.py).
# Their own system services are not used (stopped and disabled).
#   ./scripts/install_services.sh     (apt-get, through sudo when not root; no options)
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v redis-server >/dev/null || missing+=(redis-server)
[ ${#missing[@]} = 0 ] && exit 0
echo "[install] Debian's ${missing[*]}"
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
for service in "${missing[@]}"; do
  ($SUDO systemctl disable --now "$service" 2>/dev/null || $SUDO service "$service" stop 2>/dev/null) >/dev/null || true
done
