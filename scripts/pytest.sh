#!/usr/bin/env bash
# Runs the Python client's pytest suite (client/python/tests) against this build's binaries:
#   scripts/pytest.sh BUILD_DIR MANAGER_BIN [AGENT_BIN] [pytest args...]
# (ctest's python_client_test). The suite runs in BUILD_DIR/pyenv ($KVCM_PYENV), refreshed
# by scripts/python_env.sh when the client's sources changed. Without that environment it
# skips (exit 77), unless KVCM_REQUIRE_PYTHON=1 (scripts/test.sh, CI): then it fails.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd)
abspath() { [ -z "$1" ] || echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }
KVCM_MANAGER_BIN=$(abspath "$2")
KVCM_AGENT_BIN=$(abspath "${3:-}")
export KVCM_MANAGER_BIN KVCM_AGENT_BIN
shift $(($# < 3 ? $# : 3))
venv=${KVCM_PYENV:-$build/pyenv}

if [ ! -x "$venv/bin/python" ]; then
  if [ "${KVCM_REQUIRE_PYTHON:-0}" = 1 ]; then
    echo "pytest.sh: no Python environment at $venv (scripts/python_env.sh $venv makes it)" >&2
    exit 1
  fi
  echo "pytest.sh: no Python environment at $venv; skipping (scripts/python_env.sh $venv)"
  exit 77
fi
"$repo/scripts/python_env.sh" "$venv"
export KVCM_SOURCE_ROOT=$repo
# A real vLLM's python, for test_real_vllm.py (scripts/vllm_env.sh BUILD_DIR/vllm-venv).
export KVCM_VLLM_PYTHON=${KVCM_VLLM_PYTHON:-$build/vllm-venv/bin/python}
# SGLang's python, for test_real_sglang.py and test_sglang_hicache.py (scripts/sglang_env.sh
# BUILD_DIR/sglang-venv).
export KVCM_SGLANG_PYTHON=${KVCM_SGLANG_PYTHON:-$build/sglang-venv/bin/python}
# From the tests' directory, never client/python: the source tree's kvcm has no stubs.
cd "$repo/client/python/tests"
exec "$venv/bin/pytest" -q -p no:cacheprovider "$@"
