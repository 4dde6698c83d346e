#!/usr/bin/env bash
# Installs the Debian 12 packages kvcm builds, tests and serves with (clang and
# libclang-rt-14-dev, which holds libclang_rt.fuzzer, build the fuzz/ harnesses; libssl-dev
# is the agents' TLS data port, openssl makes the tests' certificates; python3-venv and
# python3-dev build and test the Python client; etcd-server is the managers' leader election
# in the HA tests).
# Does nothing when everything is already there; needs root (or sudo) otherwise.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config curl
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev openssl
  clang-format prometheus etcd-server
  clang libclang-rt-14-dev
  python3-venv python3-dev
)

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
