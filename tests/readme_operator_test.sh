#!/usr/bin/env bash
# README's "Operating a cluster" step 2 (certificates, tokens, Secrets, the overlay with the
# images set, the monitoring ConfigMaps), run as written by tests/readme_demo_test.sh with
# kubectl from VENV (scripts/k8s_env.sh) on PATH. Needs no cluster. Skips (exit 77) without
# that kubectl, unless KVCM_REQUIRE_K8S=1.
#   tests/readme_operator_test.sh README.md BUILD_DIR [VENV]   # VENV: BUILD_DIR/k8s-venv
set -euo pipefail
readme=$1 build=$2 venv=${3:-$2/k8s-venv}
if [ ! -x "$venv/bin/kubectl" ]; then
  if [ "${KVCM_REQUIRE_K8S:-0}" = 1 ]; then
    echo "FAIL: no kubectl in $venv (scripts/k8s_env.sh $venv)" >&2
    exit 1
  fi
  echo "SKIP: no kubectl in $venv (scripts/k8s_env.sh $venv makes it)"
  exit 77
fi
PATH="$(cd "$venv/bin" && pwd):$PATH" \
  exec "$(dirname "$0")/readme_demo_test.sh" "$readme" operator "$build"
