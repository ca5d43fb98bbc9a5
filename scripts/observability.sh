#!/usr/bin/env bash
# Start a real Prometheus (Debian's package; installed here when missing) that scrapes the
# mesh's Ray cluster through the service-discovery file Ray writes, on 127.0.0.1:9090.
#   ./scripts/observability.sh            then open http://127.0.0.1:9090
# Import dashboards/model-mesh.json into Grafana with that Prometheus as its data source.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install_prometheus.sh
exec .venv/bin/python -m serve_app.tools.prometheus "$@"
