#!/usr/bin/env bash
# Install Debian's prometheus package when the binary is missing (the mesh's observability
# script and its tests run a real Prometheus); its own system service is not used.
#   ./scripts/install_prometheus.sh     (apt-get, through sudo when not root; no options)
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
command -v prometheus >/dev/null && exit 0
echo "[install] Debian's prometheus package"
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
($SUDO systemctl disable --now prometheus 2>/dev/null || $SUDO service prometheus stop 2>/dev/null) >/dev/null || true
