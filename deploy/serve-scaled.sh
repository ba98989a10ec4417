#!/usr/bin/env bash
# `make serve-scaled WORKERS=N`: one engine process, N front ends and HAProxy on one machine.
# HAProxy listens on HOST:PORT; front ends on 127.0.0.1:PORT+1 .. PORT+N (route keys w1..wN).
# The front ends are supervised (docs/scale.md): a crashed one is started again, and
# `kill -HUP <pid>` (the pid `duplex-server serve --workers` prints) restarts them one by one.
set -euo pipefail
CONFIG=${CONFIG:-configs/cpu.yaml}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
WORKERS=${WORKERS:-2}
BIN=${BIN:-.venv/bin}
cfg=$(mktemp --suffix .haproxy.cfg)
"$BIN/duplex-server" haproxy-config --workers "$WORKERS" --host 127.0.0.1 \
  --port $((PORT + 1)) --bind "$HOST:$PORT" > "$cfg"
# HAProxy starts once every front end answers /health: started earlier, its health checks
# would find them all down while the models load and log "[ALERT] ... no server available".
(
  for i in $(seq 1 "$WORKERS"); do
    until "$BIN/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$((PORT + i))/health" 2>/dev/null; do
      sleep 0.5
    done
  done
  echo "HAProxy on http://$HOST:$PORT in front of $WORKERS front ends"
  exec haproxy -db -f "$cfg"
) &
lb=$!
trap 'kill "$lb" 2>/dev/null || true; rm -f "$cfg"' EXIT
"$BIN/duplex-server" serve --config "$CONFIG" --host 127.0.0.1 --port $((PORT + 1)) \
  --workers "$WORKERS"
