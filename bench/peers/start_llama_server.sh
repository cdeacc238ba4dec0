#!/usr/bin/env bash
# llama.cpp's llama-server on SmolLM2 F16 (made by install.sh), the settings of bench/README.md's comparison:
# 8 slots of 4,096 tokens (-c is shared by the slots), batch 256, 2 threads, prompt cache on.
# Foreground; stop it with SIGTERM or Ctrl-C. Extra arguments go to the server.
set -euo pipefail
P=${PEERS:?set PEERS to the folder install.sh filled}
exec "$P/build/llama.cpp/bin/llama-server" -m "${GGUF:-$P/models/SmolLM2-135M-Instruct-F16.gguf}" \
  --alias "${NAME:-SmolLM2-135M-Instruct}" --host 127.0.0.1 --port "${PORT:-8103}" \
  -t "${THREADS:-2}" -tb "${THREADS:-2}" -np 8 -c 32768 -b 256 -ub 256 \
  --cache-prompt --metrics "$@"
