#!/usr/bin/env bash
# Makes (or refreshes) the virtual environment the Python client's tests run in, with
# client/python installed from this checkout with its [test] extra:
#   scripts/python_env.sh DIR        # e.g. build/test/pyenv (scripts/test.sh does this)
# Reinstalls the package when its sources (client/python, proto/, common/page_hash_core.h)
# changed since the last install. Needs python3 with venv (install-deps.sh) and PyPI, or a
# pip cache that holds grpcio, grpcio-tools, protobuf and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
stamp=$venv/.kvcm-installed

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # ctest runs python_client_test and python_real_vllm_test at once
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
changed=$(find client/python/kvcm client/python/setup.py client/python/pyproject.toml \
  proto/kvcm/v1 common/page_hash_core.h -newer "$stamp" -print -quit 2>/dev/null || echo new)
if [ ! -f "$stamp" ] || [ -n "$changed" ]; then
  echo "python_env: installing client/python into $venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "./client/python[test]"
  touch "$stamp"
fi
