#!/usr/bin/env bash
# ctest's kvcm_vllm_connector_e2e_bench_smoke: bench/vllm_connector_e2e_bench.py --smoke in
# the Python client's environment (BUILD_DIR/pyenv, refreshed by scripts/python_env.sh) with
# the vLLM environment's python ($KVCM_VLLM_PYTHON, default BUILD_DIR/vllm-venv/bin/python):
#   bench/vllm_connector_e2e_smoke.sh BUILD_DIR MANAGER_BIN AGENT_BIN
# Skips (77) without either environment, unless KVCM_REQUIRE_VLLM=1 or KVCM_REQUIRE_PYTHON=1
# (scripts/test.sh): then it fails.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd)
venv=${KVCM_PYENV:-$build/pyenv}
if [ ! -x "$venv/bin/python" ]; then
  echo "no Python environment at $venv (scripts/python_env.sh $venv makes it)"
  if [ "${KVCM_REQUIRE_VLLM:-0}" = 1 ] || [ "${KVCM_REQUIRE_PYTHON:-0}" = 1 ]; then exit 1; fi
  exit 77
fi
"$repo/scripts/python_env.sh" "$venv"
export KVCM_VLLM_PYTHON=${KVCM_VLLM_PYTHON:-$build/vllm-venv/bin/python}
exec "$venv/bin/python" "$repo/bench/vllm_connector_e2e_bench.py" --smoke \
  --manager_bin "$2" --agent_bin "$3"
