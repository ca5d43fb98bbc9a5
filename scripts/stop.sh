#!/usr/bin/env bash
# Stop everything the demo and the guides start on this host, and check that nothing is left:
# the Serve applications (serve shutdown), the tenant counts actor (detached: it outlives
# serve shutdown), scripts/observability.sh's Prometheus, then Ray on this node (ray stop).
# Exit 0 when nothing is left; else 1, with one line per process or port still in use.
#   ./scripts/stop.sh                 everything (ray stop stops every Ray of this user here)
#   ./scripts/stop.sh --keep-ray      the mesh, its counts actor and Prometheus; Ray stays up
#   ./scripts/stop.sh --help          the options and their defaults
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}   # as scripts/demo.sh starts Ray
exec .venv/bin/python -m bench.full_stop "$@"
