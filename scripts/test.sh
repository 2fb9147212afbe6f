#!/usr/bin/env bash
# Run the whole suite: unit (no Ray), then integration and e2e (local Ray, real servers),
# then multinode (Ray nodes in network namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DUET_VENV:-.venv}
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0 RAY_AUTH_MODE=disabled
if [ -x scripts/redis.sh ]; then bash scripts/redis.sh start || echo "redis unavailable: its tests will skip"; fi
"$VENV/bin/python" -m pytest -m unit -q -p no:cacheprovider
# Separate invocations: the integration session owns one Ray cluster until it ends,
# and e2e starts `duet serve`, which brings up (and tears down) a Ray of its own.
"$VENV/bin/python" -m pytest -m integration -q -p no:cacheprovider tests/integration
"$VENV/bin/python" -m pytest -m e2e -q -p no:cacheprovider tests/e2e
# Three Ray nodes in network namespaces (root; skipped without): a cluster of its own.
"$VENV/bin/python" -m pytest -m multinode -q -p no:cacheprovider tests/multinode
