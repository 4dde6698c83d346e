#!/usr/bin/env bash
# Installs the Debian 12 packages kvcm builds, tests and serves with.
#   ./scripts/install-deps.sh          # everything scripts/test.sh needs
#   ./scripts/install-deps.sh serve    # only what building and serving need (scripts/run.sh)
# The test-only packages: clang and libclang-rt-14-dev (libclang_rt.fuzzer) build the fuzz/
# harnesses; GoogleTest and Google Benchmark the tests and benchmarks; clang-format the
# format check; prometheus (promtool) and etcd-server (the managers' leader election) the
# metrics and HA tests; python3-venv and python3-dev the Python client's tests. libssl-dev
# is the agents' TLS data port; openssl makes certificates.
# Does nothing when everything is already there; needs root (or sudo) otherwise.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config curl
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev
  libssl-dev openssl
)
case ${1:-all} in
  serve) ;;
  all)
    packages+=(
      libgtest-dev libgmock-dev libbenchmark-dev
      clang-format prometheus etcd-server
      clang libclang-rt-14-dev
      python3-venv python3-dev
    )
    ;;
  *)
    echo "usage: $0 [serve|all]" >&2
    exit 2
    ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
