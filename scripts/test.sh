#!/usr/bin/env bash
# Run the whole suite: lint and types, unit (no Ray), then integration and e2e (local Ray,
# real servers), then multinode (Ray nodes in network namespaces). Each stage prints
# its wall time, so where the suite's time goes is in every CI log.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DUET_VENV:-.venv}
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0 RAY_AUTH_MODE=disabled
stage() {  # stage NAME COMMAND...: run it, say how long it took, return its status
    local name=$1 start=$SECONDS rc=0
    shift
    "$@" || rc=$?
    echo "test.sh: stage $name took $((SECONDS - start)) s (exit $rc)"
    return $rc
}
# The suite's time depends on the CPU (AVX-512 or AVX2 only changes every model step ~2x): say which.
echo "test.sh: $(nproc) cores; CPU $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | xargs);" \
     "flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile' /proc/cpuinfo 2>/dev/null | tr '\n' ' ')" || true
stage lint bash scripts/lint.sh
if [ -x scripts/redis.sh ]; then bash scripts/redis.sh start || echo "redis unavailable: its tests will skip"; fi
# Two workers: unit tests run torch on one thread (tests/unit/conftest.py), so one
# process leaves a core idle.
stage unit "$VENV/bin/python" -m pytest -m unit -q -p no:cacheprovider -n 2 --durations=8
# Separate invocations: the integration session owns one Ray cluster until it ends,
# and e2e starts `duet serve`, which brings up (and tears down) a Ray of its own.
# Multinode (three Ray nodes in network namespaces; root, skipped without) runs beside
# integration: its nodes, ports, Redis and processes are all its own, and integration
# leaves a fifth of both cores idle (lease TTLs, replica restarts, autoscaler windows)
# that multinode, idle half its time, fills. Its log is printed when it ends.
multinode_log=$(mktemp)
stage multinode "$VENV/bin/python" -m pytest -m multinode -q -p no:cacheprovider --durations=5 tests/multinode \
    >"$multinode_log" 2>&1 &
multinode_pid=$!
trap 'pkill -TERM -P "$multinode_pid" 2>/dev/null || true' EXIT  # this script stopped early: stop it too
integration_rc=0
stage integration "$VENV/bin/python" -m pytest -m integration -q -p no:cacheprovider --durations=12 tests/integration \
    || integration_rc=$?
multinode_rc=0
wait "$multinode_pid" || multinode_rc=$?
trap - EXIT
echo "test.sh: ---- multinode's log ----"
cat "$multinode_log"
rm -f "$multinode_log"
if [ "$integration_rc" != 0 ] || [ "$multinode_rc" != 0 ]; then
    echo "test.sh: integration exit $integration_rc, multinode exit $multinode_rc" >&2
    exit 1
fi
stage e2e "$VENV/bin/python" -m pytest -m e2e -q -p no:cacheprovider --durations=5 tests/e2e
# The image (deploy/Containerfile) built and booted: slow, so only when asked for.
if [ "${DUET_IMAGE_TEST:-0}" = 1 ]; then
    stage image-build bash scripts/image.sh
    stage image "$VENV/bin/python" -m pytest -m image -q -p no:cacheprovider tests/image
fi
