#!/usr/bin/env bash
# Local Redis for duet's shared prefix index and remote KV tier.
#
#   scripts/redis.sh start|stop|status
#
# Listens on ${DUET_REDIS_HOST:-127.0.0.1}:${DUET_REDIS_PORT:-6390} (never 6379: Ray's GCS uses it),
# daemonized, pidfile, log and data under ${DUET_REDIS_DIR:-/tmp/duet-redis}.
# Installs Debian's redis-server with apt-get if it is missing. Idempotent.
set -euo pipefail

PORT="${DUET_REDIS_PORT:-6390}"
HOST="${DUET_REDIS_HOST:-127.0.0.1}"
DIR="${DUET_REDIS_DIR:-/tmp/duet-redis}"
PIDFILE="$DIR/redis-$PORT.pid"

if [[ "$PORT" == "6379" ]]; then
    echo "redis.sh: port 6379 is Ray's; pick another DUET_REDIS_PORT" >&2
    exit 2
fi

ping() {
    command -v redis-cli >/dev/null 2>&1 &&
        [[ "$(redis-cli -h "$HOST" -p "$PORT" ping 2>/dev/null)" == "PONG" ]]
}

install() {
    command -v redis-server >/dev/null 2>&1 && return 0
    echo "redis.sh: installing redis-server with apt-get"
    local sudo=""
    [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    if ! $sudo apt-get install -y -q --no-install-recommends redis-server >/dev/null; then
        $sudo apt-get update -q >/dev/null
        $sudo apt-get install -y -q --no-install-recommends redis-server >/dev/null
    fi
    # The package may start a system service on 6379; duet does not use it.
}

start() {
    if ping; then
        echo "redis.sh: already running on $HOST:$PORT"
        return 0
    fi
    install
    mkdir -p "$DIR"
    # Redis has no password here: off loopback (a private bridge of the multi-node
    # test cluster) protected mode would refuse every other host.
    local protected=yes
    [[ "$HOST" != "127.0.0.1" ]] && protected=no
    redis-server \
        --bind "$HOST" --port "$PORT" --protected-mode "$protected" \
        --daemonize yes --pidfile "$PIDFILE" \
        --dir "$DIR" --logfile "$DIR/redis-$PORT.log" \
        --dbfilename "dump-$PORT.rdb" --save "" --appendonly no
    for _ in $(seq 50); do
        if ping; then
            echo "redis.sh: started on $HOST:$PORT (dir $DIR)"
            return 0
        fi
        sleep 0.1
    done
    echo "redis.sh: redis-server did not answer on port $PORT; see $DIR/redis-$PORT.log" >&2
    exit 1
}

stop() {
    if ping; then
        redis-cli -h "$HOST" -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
    elif [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        kill "$(cat "$PIDFILE")"
    fi
    for _ in $(seq 50); do
        ping || break
        sleep 0.1
    done
    rm -f "$PIDFILE"
    echo "redis.sh: stopped (port $PORT)"
}

status() {
    if ping; then
        echo "redis.sh: running on $HOST:$PORT"
    else
        echo "redis.sh: not running (port $PORT)"
        return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *)
        echo "usage: $0 start|stop|status" >&2
        exit 2
        ;;
esac
