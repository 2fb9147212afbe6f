#!/usr/bin/env bash
# Run the whole suite: lint and types, then integration (local Ray, real servers) with
# unit (no Ray), multinode (Ray nodes in network namespaces), e2e (`duet serve`) and the
# rest of integration beside it. Each stage prints its wall time, so where the suite's
# time goes is in every CI log.
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
# Separate invocations: the integration session owns one Ray cluster until it ends;
# multinode (three Ray nodes in network namespaces; root, skipped without) and e2e
# (`duet serve`, which brings up and tears down a Ray of its own) each start their own.
# Integration alone keeps fewer than two threads runnable most of the time (one engine
# step at a time per request's path; lease TTLs, replica restarts and autoscaler
# windows idle), so the other stages run beside it, one after the other: unit (no Ray;
# two workers, torch on one thread each: tests/unit/conftest.py), then multinode, then
# e2e, then the late part of integration (a few configs on a Ray cluster of their own,
# in e2e's namespace), so that both lanes end about together. Two more clusters at once
# would not fit in memory. Multinode's nodes, ports, Redis and processes are all its
# own, and e2e and the late part run in a network namespace with only a loopback of its
# own (root; without one, e2e runs after integration and integration is whole). On a
# machine shared with a busy process, the scheduler gives the suite a share of that
# process's core only while three or more of the suite's threads are runnable: a stage
# run alone would get one core. Their log is printed when they end.
# unit: the pure logic (under a minute); model: the unit tests that run the real model,
# an engine core child or another subprocess (tests/unit/conftest.py marks them).
unit() { "$VENV/bin/python" -m pytest -m "unit and not model" -q -p no:cacheprovider -n 2 --durations=8 tests/unit; }
model() { "$VENV/bin/python" -m pytest -m model -q -p no:cacheprovider -n 2 --durations=8 tests/unit; }
E2E_NS=duet-e2e-$$
e2e_netns_up() {
    [ "$(id -u)" = 0 ] && command -v ip >/dev/null || return 1
    ip netns add "$E2E_NS" 2>/dev/null && ip -n "$E2E_NS" link set lo up || return 1
    # `ip netns exec` mounts this over /etc/resolv.conf: a lookup fails at once, never times out.
    mkdir -p "/etc/netns/$E2E_NS" && echo "nameserver 127.0.0.1" >"/etc/netns/$E2E_NS/resolv.conf"
}
e2e_netns_down() { ip netns del "$E2E_NS" 2>/dev/null || true; rm -rf "/etc/netns/$E2E_NS"; }
integration() {
    "$VENV/bin/python" -m pytest -m integration -q -p no:cacheprovider --durations=12 tests/integration "$@"
}
# The integration configs that run beside the rest, in e2e's network namespace once e2e
# has ended, on a Ray cluster of their own: the lane beside integration ends minutes
# before it otherwise (docs/testing.md). Ports, Redis and processes are the namespace's.
LATE_CONFIGS=tiers,tiers-disk,secure
late_integration() { "$@" "$VENV/bin/python" -m pytest -m integration -q -p no:cacheprovider --durations=5 \
    tests/integration --configs "$LATE_CONFIGS"; }
e2e() { "$@" "$VENV/bin/python" -m pytest -m e2e -q -p no:cacheprovider --durations=5 tests/e2e; }
kill_tree() { local child; for child in $(pgrep -P "$1"); do kill_tree "$child"; done; kill -TERM "$1" 2>/dev/null || true; }
e2e_beside=0
if e2e_netns_up; then e2e_beside=1; else e2e_netns_down; fi
beside() {
    local rc=0
    stage unit unit || rc=1
    stage model model || rc=1
    stage multinode "$VENV/bin/python" -m pytest -m multinode -q -p no:cacheprovider --durations=5 tests/multinode \
        || rc=1
    if [ "$e2e_beside" = 1 ]; then
        stage e2e e2e ip netns exec "$E2E_NS" || rc=1
        stage "integration (late part)" late_integration ip netns exec "$E2E_NS" || rc=1
    fi
    return $rc
}
beside_log=$(mktemp)
beside >"$beside_log" 2>&1 &
beside_pid=$!
trap 'kill_tree "$beside_pid"; e2e_netns_down' EXIT  # this script stopped early: stop them too
integration_rc=0
if [ "$e2e_beside" = 1 ]; then
    stage integration integration --skip-configs "$LATE_CONFIGS" || integration_rc=$?
else
    stage integration integration || integration_rc=$?
fi
beside_rc=0
wait "$beside_pid" || beside_rc=$?
trap - EXIT
e2e_netns_down
echo "test.sh: ---- the log of what ran beside integration ----"
cat "$beside_log"
rm -f "$beside_log"
if [ "$integration_rc" != 0 ] || [ "$beside_rc" != 0 ]; then
    echo "test.sh: integration exit $integration_rc; unit, multinode, e2e or integration's late part failed: $beside_rc" >&2
    exit 1
fi
if [ "$e2e_beside" = 0 ]; then stage e2e e2e; fi
# The image (deploy/Containerfile) built and booted: slow, so only when asked for.
if [ "${DUET_IMAGE_TEST:-0}" = 1 ]; then
    stage image-build bash scripts/image.sh
    stage image "$VENV/bin/python" -m pytest -m image -q -p no:cacheprovider tests/image
fi
