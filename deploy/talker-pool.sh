#!/usr/bin/env bash
# The AR-to-TTS route with its talker on a `vllm serve` pool (docs/scale.md, "The talker on
# a `vllm serve` pool"): three roles, one per kind of machine.
#
#   talker nodes:  deploy/talker-pool.sh talker            # one `vllm serve` of the talker
#   balancer:      deploy/talker-pool.sh lb 10.0.0.31:8100 10.0.0.32:8100 ...
#   engine host:   deploy/talker-pool.sh engine            # duplex-server, codec on its GPU
#
# A talker node needs the CUDA build of vLLM and this package without its dependencies (for
# the logits processor: pip install vllm && pip install --no-deps .). Environment knobs:
# MODEL (/models/orpheus-3b-ft), PORT (8100), TP/PP/DP (vLLM's tensor/pipeline/data
# parallel sizes, 1), EXECUTOR (mp or ray; ray needs `ray start` on every node first),
# BIND (the balancer's address, 10.0.0.30:8100), CONFIG (configs/gpu-talker-remote.yaml,
# whose talker base_url must name the balancer), BIN (.venv/bin).
set -euo pipefail
role=${1:-}
shift || true
MODEL=${MODEL:-/models/orpheus-3b-ft}
PORT=${PORT:-8100}
BIN=${BIN:-.venv/bin}
case "$role" in
  talker)
    args=()
    [[ -n "${EXECUTOR:-}" ]] && args+=(--distributed-executor-backend "$EXECUTOR")
    exec vllm serve "$MODEL" --served-model-name talker --host 0.0.0.0 --port "$PORT" \
      --dtype bfloat16 --max-model-len 2048 --max-num-seqs 128 --enable-prefix-caching \
      --scheduling-policy priority \
      --tensor-parallel-size "${TP:-1}" --pipeline-parallel-size "${PP:-1}" \
      --data-parallel-size "${DP:-1}" "${args[@]}" \
      --logits-processors engine.stages.talker_logits:CodecFrameLogits
    ;;
  lb)
    [[ $# -ge 1 ]] || { echo "usage: $0 lb HOST:PORT [HOST:PORT ...]" >&2; exit 2; }
    cfg=$(mktemp --suffix .haproxy.cfg)
    trap 'rm -f "$cfg"' EXIT
    sed -n '/^global/,/^backend talkers/p' deploy/talker-pool.haproxy.cfg \
      | sed "s|^    bind .*|    bind ${BIND:-10.0.0.30:8100}|" > "$cfg"
    printf '    balance leastconn\n    option httpchk GET /health\n' >> "$cfg"
    printf '    http-check expect status 200\n' >> "$cfg"
    i=0
    for server in "$@"; do
      i=$((i + 1))
      echo "    server t$i $server check inter 1s rise 2 fall 2" >> "$cfg"
    done
    haproxy -c -f "$cfg"
    haproxy -db -f "$cfg"
    ;;
  engine)
    exec "$BIN/duplex-server" serve --config "${CONFIG:-configs/gpu-talker-remote.yaml}" \
      --host 0.0.0.0 --port "${ENGINE_PORT:-8000}"
    ;;
  *)
    echo "usage: $0 talker | lb HOST:PORT... | engine   (see the header)" >&2
    exit 2
    ;;
esac
