#!/usr/bin/env bash
# A README walk-through with real vLLM engines (the engines-vllm block, or the block NAME),
# with the vLLM environment at BUILD_DIR/vllm-venv (scripts/vllm_env.sh). Skips (exit 77)
# without it, unless KVCM_REQUIRE_VLLM=1 (scripts/test.sh, CI): then it fails.
#   tests/readme_vllm_demo_test.sh README.md BUILD_DIR [NAME]
set -euo pipefail
readme=$1 build=$2 name=${3:-engines-vllm}
if [ ! -x "$build/vllm-venv/bin/python" ]; then
  if [ "${KVCM_REQUIRE_VLLM:-0}" = 1 ]; then
    echo "readme $name demo: no vLLM environment at $build/vllm-venv" >&2
    exit 1
  fi
  echo "readme $name demo: no vLLM environment at $build/vllm-venv; skipping"
  exit 77
fi
# Two engines load (about 30 s each, at once) while pip installs the client.
DEMO_TIMEOUT_S=${DEMO_TIMEOUT_S:-240} \
  exec "$(dirname "$0")/readme_python_demo_test.sh" "$readme" "$build" "$name"
