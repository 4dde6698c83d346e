#!/usr/bin/env bash
# A README walk-through with SGLang's own code (the block NAME: engines-sglang or
# hicache-sglang), with the SGLang environment at BUILD_DIR/sglang-venv (scripts/sglang_env.sh).
# Skips (exit 77) without it, unless KVCM_REQUIRE_SGLANG=1 (scripts/test.sh, CI): then it fails.
#   tests/readme_sglang_demo_test.sh README.md BUILD_DIR NAME
set -euo pipefail
readme=$1 build=$2 name=$3
if [ ! -x "$build/sglang-venv/bin/python" ]; then
  if [ "${KVCM_REQUIRE_SGLANG:-0}" = 1 ]; then
    echo "readme $name demo: no SGLang environment at $build/sglang-venv" >&2
    exit 1
  fi
  echo "readme $name demo: no SGLang environment at $build/sglang-venv; skipping"
  exit 77
fi
exec "$(dirname "$0")/readme_python_demo_test.sh" "$readme" "$build" "$name"
