#!/usr/bin/env bash
# Run the whole suite: lint and types, unit (no Ray), then integration and e2e (local Ray,
# real servers), then multinode (Ray nodes in network namespaces). Each stage prints
# its wall time, so where the suite's time goes is in every CI log.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DUET_VENV:-.venv}
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0 RAY_AUTH_MODE=disabled
stage() {  # stage NAME COMMAND...: run it and say how long it took
    local name=$1 start=$SECONDS
    shift
    "$@"
    echo "test.sh: stage $name took $((SECONDS - start)) s"
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
stage integration "$VENV/bin/python" -m pytest -m integration -q -p no:cacheprovider --durations=12 tests/integration
stage e2e "$VENV/bin/python" -m pytest -m e2e -q -p no:cacheprovider --durations=5 tests/e2e
# Three Ray nodes in network namespaces (root; skipped without): a cluster of its own.
stage multinode "$VENV/bin/python" -m pytest -m multinode -q -p no:cacheprovider --durations=5 tests/multinode
# The image (deploy/Containerfile) built and booted: slow, so only when asked for.
if [ "${DUET_IMAGE_TEST:-0}" = 1 ]; then
    stage image-build bash scripts/image.sh
    stage image "$VENV/bin/python" -m pytest -m image -q -p no:cacheprovider tests/image
fi
