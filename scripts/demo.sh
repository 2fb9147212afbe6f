#!/usr/bin/env bash
# The README's `make demo`: start `duet serve` (1 prefill + 1 decode replica) on port
# 8000, ask it one chat question, run a 20-request load test, and stop the server on
# any exit (Ctrl-C included). About 2-3 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DUET_VENV:-.venv}
PORT=${DUET_DEMO_PORT:-8000}
URL="http://127.0.0.1:$PORT"
READY_TIMEOUT=${DUET_DEMO_READY_TIMEOUT:-240}
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 PYTHONHASHSEED=0 RAY_AUTH_MODE=disabled

[ -x "$VENV/bin/duet" ] || bash scripts/setup.sh
DUET="$VENV/bin/duet"
PY="$VENV/bin/python"

if curl -s -o /dev/null "$URL/health"; then
    echo "demo: something already answers on port $PORT; set DUET_DEMO_PORT" >&2
    exit 1
fi

LOG=$(mktemp -t duet-demo.XXXXXX)
SERVER=""
stop_server() {
    [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null || return 0
    echo "== stopping duet serve"
    # SIGTERM, not SIGINT: a background job of a script has SIGINT ignored.
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
    kill -0 "$SERVER" 2>/dev/null && kill -KILL "$SERVER" 2>/dev/null
    wait "$SERVER" 2>/dev/null || true
    echo "stopped (server log: $LOG)"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

echo "== starting duet serve on port $PORT (log: $LOG)"
"$DUET" serve --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
deadline=$((SECONDS + READY_TIMEOUT))
until grep -q "duet is serving" "$LOG"; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "demo: duet serve exited before it was ready:" >&2; tail -n 30 "$LOG" >&2; exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "demo: duet serve not ready after ${READY_TIMEOUT}s:" >&2; tail -n 30 "$LOG" >&2; exit 1
    fi
    sleep 1
done
grep "duet is serving" "$LOG"
MODEL=$(curl -s "$URL/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')

echo
echo "== one chat completion: POST $URL/v1/chat/completions"
curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\", \"max_tokens\": 48, \"temperature\": 0,
  \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France? Answer in one sentence.\"}]
}" | "$PY" -c '
import json, sys
r = json.load(sys.stdin)
if "choices" not in r:
    sys.exit(f"unexpected answer: {r}")
print("assistant:", r["choices"][0]["message"]["content"].strip())
u = r.get("usage") or {}
print("usage: %s prompt + %s completion tokens" % (u.get("prompt_tokens"), u.get("completion_tokens")))'

echo
echo "== load test: 20 chat requests, Poisson at 2 req/s, 32-96 tokens in, 32 out"
"$DUET" bench serve --base-url "$URL" --model "$MODEL" --endpoint chat --input-len uniform:32:96 \
    --output-len 32 --ignore-eos --num-prompts 20 --request-rate 2 --goodput ttft:2000 tpot:250 --no-progress
