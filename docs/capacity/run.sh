#!/usr/bin/env bash
# The capacity-planning session of docs/capacity.md, end to end: start `duet serve`
# (1 prefill + 1 decode replica), measure each pool, plan for a target, validate the
# plan scaled down on this cluster, stop the server. Outputs land next to this file.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=docs/capacity
PORT=${PORT:-8011}
URL=http://127.0.0.1:$PORT
DUET=.venv/bin/duet
LOG=$(mktemp -t duet-capacity.XXXXXX)

$DUET serve --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until grep -q "duet is serving" "$LOG"; do
    kill -0 $SERVER 2>/dev/null || { tail -n 30 "$LOG"; exit 1; }
    sleep 1
done
grep "duet is serving" "$LOG" | tee "$OUT/server.txt"

set -x
# 1. prefill-heavy: long prompts, one output token, open loop from light to heavy load
$DUET bench serve --base-url "$URL" --workload long-in-short-out --input-len uniform:128:768 \
    --output-len 1 --num-prompts 10 --request-rate 0.25 0.5 0.8 --goodput ttft:2000 \
    --no-progress --out "$OUT/prefill" | tee "$OUT/prefill.txt"
# 2. decode-heavy: short prompts, 48 forced output tokens, closed loop at growing batch
$DUET bench serve --base-url "$URL" --workload short-in-long-out --input-len 32 --output-len 48 \
    --ignore-eos --num-prompts 8 --concurrency 1 2 4 8 --goodput tpot:200 \
    --no-progress --out "$OUT/decode" | tee "$OUT/decode.txt"
# 3. plan for 4 req/s of 64-256 token prompts and 32-token answers, then validate
#    it scaled down to this 1 + 1 cluster
$DUET plan --prefill-sweep "$OUT/prefill/results.json" --decode-sweep "$OUT/decode/results.json" \
    --rate 4 --input-len uniform:64:256 --output-len 32 --goodput ttft:2000 tpot:200 \
    --goodput-target 0.9 --num-requests 2000 --out "$OUT/plan.json" \
    --validate --base-url "$URL" --validate-num-prompts 30 --no-progress \
    --validate-out "$OUT/validation" | tee "$OUT/plan.txt"
