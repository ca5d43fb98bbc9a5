#!/usr/bin/env bash
# Run a real Prometheus (Debian's package; installed here when missing) that scrapes the
# mesh's Ray cluster through the service-discovery file Ray writes, on 127.0.0.1:9090. It runs
# in the foreground: Ctrl-C, SIGTERM or SIGHUP to this script stop Prometheus too.
#   ./scripts/observability.sh [--port 9090] [--data-dir /tmp/mesh-prometheus]
#   ./scripts/observability.sh &        in the background; ./scripts/stop.sh stops it (pid file)
#   ./scripts/observability.sh --help   every option and its default
# Then open http://127.0.0.1:9090, or import dashboards/model-mesh.json into Grafana with
# that Prometheus as its data source.
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in *" -h "*|*" --help "*) ;; *) ./scripts/install_services.sh;; esac
exec .venv/bin/python -m bench.local_prometheus "$@"
