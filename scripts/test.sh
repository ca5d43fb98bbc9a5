#!/usr/bin/env bash
# Run the whole test suite (sets up first; integration tests start real Ray, Serve and vLLM).
#   ./scripts/test.sh                 everything
#   ./scripts/test.sh -m "not integration"   fast unit tests only
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/install_prometheus.sh   # tests/test_observability.py runs a real Prometheus
exec .venv/bin/python -m pytest -v --durations=15 "$@"
