#!/usr/bin/env bash
# Install Debian's prometheus package when the binary is missing (the mesh's observability
# script and its tests run a real Prometheus); its own system service is not used.
set -euo pipefail
command -v prometheus >/dev/null && exit 0
echo "[install] Debian's prometheus package"
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
($SUDO systemctl disable --now prometheus 2>/dev/null || $SUDO service prometheus stop 2>/dev/null) >/dev/null || true
