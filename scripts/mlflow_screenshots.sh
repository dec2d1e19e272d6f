#!/usr/bin/env bash
# Screenshots of the MLflow UI for docs/: serve a store with `mlflow server`, load pages in headless Chromium.
# Usage: scripts/mlflow_screenshots.sh TRACKING_URI ARTIFACT_ROOT OUT_DIR NAME=URL_FRAGMENT...
#   e.g. scripts/mlflow_screenshots.sh sqlite:////tmp/h/mlflow.db /tmp/h/artifacts docs/img \
#          parent-run='#/experiments/1/runs/<id>' report='#/experiments/1/runs/<id>/artifacts/report.html'
# HEIGHT (px, default 1000) sets the window height. Needs Debian's `chromium` (apt-get install chromium). Each page gets a 15 s virtual-time budget to render.
set -euo pipefail
uri=$1 artifacts=$2 out=$3; shift 3
port=${PORT:-5077}
mkdir -p "$out"
MLFLOW_DISABLE_TELEMETRY=true .venv/bin/mlflow server --backend-store-uri "$uri" --default-artifact-root "$artifacts" \
  --host 127.0.0.1 --port "$port" >"$out/.mlflow-server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$out/.mlflow-server.log"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
for page in "$@"; do
  name=${page%%=*} frag=${page#*=}
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1500,${HEIGHT:-1000} \
    --virtual-time-budget=15000 --screenshot="$out/$name.png" "http://127.0.0.1:$port/$frag" 2>/dev/null
  echo "wrote $out/$name.png"
done
