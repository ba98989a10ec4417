#!/usr/bin/env bash
# One prepared GPU check (docs/gpu.md): on a machine with an NVIDIA GPU, the CUDA build of
# vLLM and the project installed (`pip install -e . vllm`), and the model available locally
# or from the hub:
#   1. derive a config from configs/gpu-vllm.yaml with a small model ($MODEL),
#   2. start the server on it and time start-up until /health is 200,
#   3. run bench/turn_latency.py on that config (time to first audio of spoken turns),
#   4. run bench/realtime.py for 1, 8 and 32 sessions,
#   5. print one table (and write $OUT/gpu_check.json),
#   6. the talker route (docs/gpu.md): bench/talker.py on the talker and codec stages of
#      configs/gpu-talker.yaml as users deploy it (TALKER_MODEL / SNAC_MODEL: real weights,
#      else the tiny talker and random SNAC), if snac is installed
#      (`pip install snac==1.2.1 einops`),
#   7. the talker's frame logits processor: bench/talker_logits.py --device cuda (per-row
#      loop vs batched mask, ms and ops per step at 1/32/128/256 rows; needs only torch).
#
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct PY=python bench/gpu_check.sh
# Env: MODEL, PY (python with the project), OUT (results dir), PORT, SESSIONS ("1 8 32"),
#      START_TIMEOUT_S (600), QUICK (1: pass --quick to the benches), TALKER_MODEL,
#      SNAC_MODEL (directories; unset: tiny talker, random-weight SNAC).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
OUT=${OUT:-bench/results/gpu}
PORT=${PORT:-8765}
SESSIONS=${SESSIONS:-"1 8 32"}
START_TIMEOUT_S=${START_TIMEOUT_S:-600}
QUICK=${QUICK:-1}
quick=(); [[ $QUICK == 1 ]] && quick=(--quick)
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import vllm, torch; assert torch.cuda.is_available(); print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"

# 1. the GPU config with the small model
CONFIG="$OUT/gpu-small.yaml"
"$PY" - "$MODEL" "$CONFIG" <<'PYEOF'
import sys, yaml
model, dest = sys.argv[1], sys.argv[2]
cfg = yaml.safe_load(open("configs/gpu-vllm.yaml"))
llm = cfg["engine"]["stages"]["llm"]["options"]
llm.update(model=model, max_model_len=2048, gpu_memory_utilization=0.5)
yaml.safe_dump(cfg, open(dest, "w"), sort_keys=False)
PYEOF

# 2. start-up time of the server on it
"$PY" -m duplex_server serve --config "$CONFIG" --port "$PORT" --log-level warning \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
t0=$(date +%s%N)
until "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$PORT/health" 2>/dev/null; do
  kill -0 "$SERVER" 2>/dev/null || { echo "server died:"; tail -40 "$OUT/server.log"; exit 1; }
  if (( ($(date +%s%N) - t0) / 1000000000 > START_TIMEOUT_S )); then
    echo "server not ready after ${START_TIMEOUT_S}s"; tail -40 "$OUT/server.log"; exit 1
  fi
  sleep 0.5
done
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
START_S=$(( ms / 1000 )).$(( ms % 1000 / 100 ))
echo "server ready in ${START_S}s"
kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
trap - EXIT

# 3. time to first audio of spoken turns, on the GPU config (in-process engine)
"$PY" bench/turn_latency.py --config "$CONFIG" "${quick[@]}" --json "$OUT/turn_latency.json" \
  | tee "$OUT/turn_latency.txt"

# 4. the realtime server benchmark at 1/8/32 sessions (on the GPU config where the script
#    takes --config; otherwise on its own test-stage config: server overhead only)
rt_config=()
if "$PY" bench/realtime.py --help 2>/dev/null | grep -q -- "--config"; then
  rt_config=(--config "$CONFIG")
fi
for n in $SESSIONS; do
  "$PY" bench/realtime.py --sessions "$n" "${quick[@]}" "${rt_config[@]}" \
    --json "$OUT/realtime_$n.json" | tee "$OUT/realtime_$n.txt"
done

# 5. one table
"$PY" - "$OUT" "$MODEL" "$START_S" "$SESSIONS" <<'PYEOF'
import json, sys
from pathlib import Path
out, model, start_s, sessions = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4].split()
tl = json.loads((out / "turn_latency.json").read_text())
rows = []
for n in sessions:
    rt = json.loads((out / f"realtime_{n}.json").read_text())
    step = next((s for s in rt.get("load_steps", []) if s.get("sessions") == int(n)), {})
    rows.append({
        "sessions": int(n),
        "bargein_ms_p50": rt.get("bargein_ms_p50"),
        "bargein_ms_p99": rt.get("bargein_ms_p99"),
        "stale_bytes": rt.get("stale_bytes"),
        "chunk_ms_p50": step.get("p50_ms"),
        "chunk_ms_p99": step.get("p99_ms"),
        "ok": step.get("ok"),
        "failed": step.get("failed"),
    })
summary = {"model": model, "server_start_s": round(start_s, 1),
           "ttfa_ms_p50": tl.get("ttfa_ms_p50"), "naive_ttfa_ms_p50": tl.get("naive_ttfa_ms_p50"),
           "rows": rows}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
print(f"\nGPU check: {model}; server start {start_s:.1f} s; "
      f"TTFA p50 {fmt(tl.get('ttfa_ms_p50'))} ms (naive cascade {fmt(tl.get('naive_ttfa_ms_p50'))} ms)")
cols = list(rows[0])
print("| " + " | ".join(cols) + " |")
print("|" + "---|" * len(cols))
for r in rows:
    print("| " + " | ".join(fmt(r[c]) for c in cols) + " |")
PYEOF

# 6. the talker route: codec on the GPU (batched vs serial), talker on vLLM (CUDA)
if "$PY" -c "import snac, einops" 2>/dev/null; then
  TCONFIG="$OUT/gpu-talker.yaml"
  "$PY" - "$TCONFIG" "${TALKER_MODEL:-}" "${SNAC_MODEL:-}" <<'PYEOF'
# configs/gpu-talker.yaml as shipped (its devices, memory shares, caps, codec windows and
# scheduling); only the weights change where none are given: the tiny talker, random SNAC
import sys, yaml
dest, talker_model, snac_model = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None
cfg = yaml.safe_load(open("configs/gpu-talker.yaml"))
st = cfg["engine"]["stages"]
st["talker"]["options"]["model"] = talker_model
st["codec"]["options"]["model"] = snac_model
yaml.safe_dump(cfg, open(dest, "w"), sort_keys=False)
PYEOF
  "$PY" bench/talker.py --device cuda --config "$TCONFIG" "${quick[@]}" \
    --json "$OUT/talker.json" | tee "$OUT/talker.txt"
else
  echo "talker route skipped: snac is not installed (pip install snac==1.2.1 einops)"
fi

# 7. the talker's frame logits processor on the GPU (torch only)
"$PY" bench/talker_logits.py --device cuda --json "$OUT/talker_logits.json" \
  | tee "$OUT/talker_logits.txt"
