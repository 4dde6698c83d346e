#!/usr/bin/env bash
# Builds kvcm-manager (with kvcmctl and kvcm-agent) in Release and runs the manager.
#   ./scripts/run.sh                                  # 127.0.0.1:50051, metrics on :9464
#   ./scripts/run.sh --listen_address=0.0.0.0:50051 --config=kvcm.conf
#   ./scripts/run.sh --tls_cert_file=m.pem --tls_key_file=m.key --tls_ca_file=ca.pem
# Every argument goes to kvcm-manager (see `kvcm-manager --help`). Dev mode: given no
# --tls_*, --insecure or --config argument, the manager gets --insecure (plaintext, with a
# warning in its log), so that it starts with no set-up; kvcmctl then needs --insecure too.
# It installs only what building and serving need (install-deps.sh serve: no test packages),
# and compiles the agent's CUDA kernels only where a GPU is visible (nvidia-smi lists one):
# elsewhere the agent serves host-memory pools over TCP, as every CPU-only test does.
# Environment: BUILD_DIR (default build/release), JOBS (default: nproc), KVCM_ENABLE_CUDA
# (ON/OFF/AUTO; default AUTO with a visible GPU, OFF without one).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh serve

if [ -z "${KVCM_ENABLE_CUDA:-}" ]; then
  KVCM_ENABLE_CUDA=OFF
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    KVCM_ENABLE_CUDA=AUTO
  fi
fi

build_dir=${BUILD_DIR:-build/release}
jobs=${JOBS:-$(nproc)}
# ccache's own directory (~/.cache/ccache unless CCACHE_DIR says otherwise), outside the clone.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

cmake -S . -B "$build_dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache \
  -DKVCM_ENABLE_CUDA="$KVCM_ENABLE_CUDA" \
  -DKVCM_BUILD_TESTS=OFF \
  -DKVCM_BUILD_BENCH=OFF

targets=(kvcm-manager)
# kvcmctl and kvcm-agent (README's walk-throughs use them); build them when the tree has them.
# The target list goes into a variable first: `cmake ... | grep -q` under pipefail fails when
# grep stops reading early and cmake dies of SIGPIPE, which left both unbuilt.
known=$(cmake --build "$build_dir" --target help)
for extra in kvcmctl kvcm-agent; do
  if grep -q "^$extra:" <<<"$known"; then
    targets+=("$extra")
  fi
done
cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"

args=("$@")
security_given=false
for a in "${args[@]}"; do
  case $a in --tls_* | --insecure* | --config*) security_given=true ;; esac
done
if [ "$security_given" = false ]; then
  echo "run.sh: no TLS options given: starting in dev mode with --insecure (plaintext)"
  args=(--insecure "${args[@]}")
fi

# Transparent huge pages for malloc's heap: faster index lookups (docs/PERFORMANCE.md §1).
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}
# kvcm-manager prints the gRPC and metrics addresses it actually bound on startup.
echo "run.sh: starting $build_dir/server/kvcm-manager ${args[*]}"
if [ -x "$build_dir/client/kvcmctl" ]; then
  echo "run.sh: client CLI at $build_dir/client/kvcmctl"
fi
exec "$build_dir/server/kvcm-manager" "${args[@]}"
