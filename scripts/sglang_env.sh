#!/usr/bin/env bash
# Makes (or reuses) a virtual environment with PyPI's SGLang, for the tests that drive SGLang's
# own code with kvcm behind it (its HiCache storage-backend interface and factory, its KV-event
# publisher): client/python/tests/test_sglang_*.py, ctest label "sglang".
#   scripts/sglang_env.sh DIR        # e.g. build/test/sglang-venv (scripts/test.sh does this)
# Only what those classes import, not a serving engine: sglang's wheel wants CUDA kernels
# (sglang-kernel, flashinfer, deep-gemm, ...) that neither run nor install usefully here, so
# it goes in without dependencies, after torch and the few packages its storage, memory-cache
# and KV-event modules import (found by importing them). PyPI's torch for Linux x86_64 is
# the CUDA build with its nvidia-* wheels (no CPU-only torch on PyPI); it runs on CPU.
# Idempotent: a stamp file names the pins; a changed pin reinstalls. About 6 GB; about
# 3 minutes from PyPI.
set -euo pipefail
venv=$1
sglang_version=0.5.23
torch_version=2.14.1       # sglang 0.5.23's pin
torchvision_version=0.29.2 # torch 2.14's
# What `import sglang.srt.mem_cache.storage`, `...hicache_storage`, `...mem_cache.utils`,
# `sglang.srt.disaggregation.kv_events` and `...kv_events_publisher` need; versions are
# sglang's pins where its wheel pins one.
deps=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
  "pyzmq>=25.1.2" tqdm IPython aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11"
  "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf "openai==2.8.0" partial_json_parser
  # Builds SGLang's page-hash extension (cpp_utils/hash_binding.cpp) on first use.
  ninja
  # kvcm itself (the backend runs in SGLang's processes): client/python/setup.py's pins.
  "grpcio>=1.76.0" "protobuf>=6.31.1,<7")
pins="sglang==$sglang_version torch==$torch_version torchvision==$torchvision_version ${deps[*]}"
stamp=$venv/.kvcm-sglang-installed

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pins" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
echo "sglang_env: installing sglang==$sglang_version (no dependencies) into $venv"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# No pip cache: torch's wheels (about 4 GB with the nvidia ones) would take that much again.
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
"${pip[@]}" --upgrade pip
"${pip[@]}" "torch==$torch_version" "torchvision==$torchvision_version"
"${pip[@]}" "${deps[@]}" "torch==$torch_version"
"${pip[@]}" --no-deps "sglang==$sglang_version"
"$venv/bin/python" - <<'EOF'
import sglang
import sglang.srt.disaggregation.kv_events
import sglang.srt.managers.scheduler_components.kv_events_publisher
import sglang.srt.mem_cache.hicache_storage
import sglang.srt.mem_cache.storage
import sglang.srt.mem_cache.utils
print("sglang_env: sglang", sglang.__version__)
EOF
echo "$pins" > "$stamp"
