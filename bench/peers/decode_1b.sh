#!/usr/bin/env bash
# Issue 33's realistic sizes: a random-weight checkpoint of a real model's shapes (the default
# model's tokenizer; built once into $P/models/$CHECKPOINT by bench/realistic_checkpoint.py)
# served by each named server alone, then the table of ratios. CHECKPOINT (default llama1b):
#   llama1b  Llama-3.2-1B's shapes, 16 layers: 2.15 GB in bfloat16
#   granite  granite-3.x-2b's shapes and scalars, 40 layers: 5.1 GB in bfloat16
# The servers:
#   spyre      this repo's spyre-server on the HF folder (dtype auto: bfloat16 on AVX512-BF16/AMX)
#   spyre-fp8  the same on its FP8 quantization ($P/models/$CHECKPOINT-fp8, compressed-tensors' form)
#   llama-f16  llama-server on the GGUF that llama.cpp's own convert_hf_to_gguf.py makes (F16)
#   llama-q8   the same quantized to Q8_0 by llama-quantize
#   vllm-bf16  vLLM CPU in bfloat16 (needs install.sh's venv-cpu)
# Each server gets two `spyre-server bench prefix-repetition` runs with token-id prompts of 256
# shared + 256 own tokens (PREFIX_LEN, SUFFIX_LEN) and 128 tokens out: one stream at a time (its
# inter-token latency is the single-request decode step) and 8 at a time (output tokens/s).
#   PEERS=/path/filled/by/install.sh bench/peers/decode_1b.sh [spyre] [llama-f16] [llama-q8] [vllm-bf16]
#   PEERS=... bench/peers/decode_1b.sh summary spyre llama-f16 ...   # the table of earlier runs
#   CHECKPOINT=granite PEERS=... bench/peers/decode_1b.sh spyre ...  # results in $P/results-granite
# PREFIX_LEN / SUFFIX_LEN (default 256 / 256) set the prompts' shared and own tokens, for decode
# over longer contexts (vLLM's script serves up to 4,096 tokens: PREFIX_LEN=3584 fits); pick an
# OUT of their own.
# LLAMA_ARGS go to both llama-servers (on the AMX Xeon, Q8_0's weight repacking crashed at load:
# LLAMA_ARGS=--no-repack).
# Run from the repo root with spyre-server installed in .venv; nothing else may run meanwhile.
set -euo pipefail
P=${PEERS:?set PEERS to the folder install.sh filled}
CHECKPOINT=${CHECKPOINT:-llama1b}
case $CHECKPOINT in
  llama1b) OUT=${OUT:-$P/results-1b} ;;
  granite) OUT=${OUT:-$P/results-granite} ;;
  *) echo "CHECKPOINT is llama1b or granite, not $CHECKPOINT" >&2; exit 2 ;;
esac
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=$REPO/.venv/bin/python
MODEL_DIR=$P/models/$CHECKPOINT
FP8_DIR=$P/models/$CHECKPOINT-fp8
LLAMA_SRC=$P/src/llama_cpp_python-0.3.36/vendor/llama.cpp
NAME=$CHECKPOINT
PREFIX_LEN=${PREFIX_LEN:-256}
SUFFIX_LEN=${SUFFIX_LEN:-256}
OUTPUT_LEN=128
MAX_MODEL_LEN=$(( (PREFIX_LEN + SUFFIX_LEN + OUTPUT_LEN + 2047) / 2048 * 2048 ))
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- spyre llama-f16 llama-q8

if [ ! -f "$MODEL_DIR/config.json" ]; then
  (cd "$REPO" && "$PY" -m bench.realistic_checkpoint "$CHECKPOINT" "$MODEL_DIR")
fi
if [ ! -f "$FP8_DIR/config.json" ]; then
  (cd "$REPO" && "$PY" -m bench.realistic_checkpoint "$CHECKPOINT" "$FP8_DIR" --fp8)
fi
if [ ! -f "$P/models/$CHECKPOINT-F16.gguf" ]; then
  # The converter imports sentencepiece before it falls back to tokenizer.json's BPE: it goes
  # into a folder of its own, not into the venv.
  [ -d "$P/convert-extra/sentencepiece" ] || "$PY" -m pip install --quiet --target "$P/convert-extra" sentencepiece
  PYTHONPATH=$LLAMA_SRC/gguf-py:$P/convert-extra "$PY" "$LLAMA_SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
    --outtype f16 --outfile "$P/models/$CHECKPOINT-F16.gguf"
fi
if [ ! -f "$P/models/$CHECKPOINT-Q8_0.gguf" ]; then
  "$P/build/llama.cpp/bin/llama-quantize" "$P/models/$CHECKPOINT-F16.gguf" "$P/models/$CHECKPOINT-Q8_0.gguf" Q8_0
fi

summarize() {  # names -> the table of their results in $OUT
"$PY" - "$OUT" "$@" <<'PYEOF'
import json, sys
out, servers = sys.argv[1], sys.argv[2:]
rows = {s: [json.load(open(f"{out}/{s}-c{c}.json")) for c in (1, 8)] for s in servers}
print("| server | decode, 1 stream (tok/s, 1/ITL p50) | 8 streams, output tok/s | TTFT p50, 1 stream (s) |")
print("|---|---|---|---|")
for s, (one, eight) in rows.items():
    print(f"| {s} | {1000 / one['p50_itl_ms']:.1f} | {eight['output_throughput']:.1f} | {one['p50_ttft_ms'] / 1000:.2f} |")
for mine in [s for s in ("spyre", "spyre-fp8") if s in rows]:
    ours = rows[mine]
    print()
    for s, (one, eight) in rows.items():
        if s != mine:
            print(f"{mine} over {s}: decode {one['p50_itl_ms'] / ours[0]['p50_itl_ms']:.2f}x its tok/s, "
                  f"8 streams {ours[1]['output_throughput'] / eight['output_throughput']:.2f}x")
PYEOF
}

if [ "${1:-}" = summary ]; then shift; summarize "$@"; exit 0; fi

start() {  # name -> starts the server in the background, sets PID and URL
  case $1 in
    spyre) URL=http://127.0.0.1:8031
      "$REPO/.venv/bin/spyre-server" serve --model "$MODEL_DIR" --served-model-name $NAME \
        --max-model-len $MAX_MODEL_LEN --port 8031 >"$OUT/spyre.log" 2>&1 & ;;
    spyre-fp8) URL=http://127.0.0.1:8032
      "$REPO/.venv/bin/spyre-server" serve --model "$FP8_DIR" --served-model-name $NAME \
        --dtype bfloat16 --max-model-len $MAX_MODEL_LEN --port 8032 >"$OUT/spyre-fp8.log" 2>&1 & ;;
    llama-f16) URL=http://127.0.0.1:8131
      PORT=8131 NAME=$NAME GGUF=$P/models/$CHECKPOINT-F16.gguf "$HERE/start_llama_server.sh" ${LLAMA_ARGS:-} >"$OUT/$1.log" 2>&1 & ;;
    llama-q8) URL=http://127.0.0.1:8132
      PORT=8132 NAME=$NAME GGUF=$P/models/$CHECKPOINT-Q8_0.gguf "$HERE/start_llama_server.sh" ${LLAMA_ARGS:-} >"$OUT/$1.log" 2>&1 & ;;
    vllm-bf16) URL=http://127.0.0.1:8133
      PORT=8133 NAME=$NAME MODEL=$MODEL_DIR DTYPE=bfloat16 KV_GIB=4 "$HERE/start_vllm_cpu.sh" >"$OUT/$1.log" 2>&1 & ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac
  PID=$!
  for _ in $(seq 1800); do
    if curl -sf "$URL/v1/models" >/dev/null; then return 0; fi
    if ! kill -0 "$PID" 2>/dev/null; then echo "$1 exited; see $OUT/$1.log" >&2; exit 1; fi
    sleep 1
  done
  echo "$1 did not come up; see $OUT/$1.log" >&2; exit 1
}

for server in "$@"; do
  start "$server"
  for concurrency in 1 8; do
    prompts=$((concurrency == 1 ? 3 : 16))
    "$REPO/.venv/bin/spyre-server" bench prefix-repetition --base-url "$URL" --model $NAME \
      --tokenizer "$MODEL_DIR" --num-prompts $prompts --num-prefixes 2 --prefix-len $PREFIX_LEN \
      --suffix-len $SUFFIX_LEN --output-len $OUTPUT_LEN --max-concurrency $concurrency --disable-tqdm \
      --output "$OUT/$server-c$concurrency.json" >"$OUT/$server-c$concurrency.txt"
  done
  kill -TERM "$PID"; wait "$PID" 2>/dev/null || true
done

summarize "$@"
