#!/usr/bin/env bash
# README's Python blocks (tests/readme_demo_test.sh README.md NAME BUILD_DIR; NAME defaults
# to python, the client's block; engines is the bridge-and-router walk-through). Each
# makes a fresh virtual environment and pip-installs client/python, which needs PyPI or a
# warm pip cache: it runs where the Python client's tests do (scripts/test.sh, CI, or a
# build with BUILD_DIR/pyenv) and otherwise skips (exit 77), as scripts/pytest.sh does.
set -euo pipefail
readme=$1 build=$2 name=${3:-python}
venv=${KVCM_PYENV:-$build/pyenv}
if [ ! -x "$venv/bin/python" ] && [ "${KVCM_REQUIRE_PYTHON:-0}" != 1 ]; then
  echo "readme $name demo: no Python environment at $venv; skipping"
  exit 77
fi
exec "$(dirname "$0")/readme_demo_test.sh" "$readme" "$name" "$build"
