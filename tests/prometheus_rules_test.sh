#!/usr/bin/env bash
# ctest prometheus_rules_test: checks deploy/prometheus/prometheus.yml and kvcm-alerts.yaml with
# promtool, and runs the rules' unit tests (kvcm-alerts_test.yaml), then again with the job
# names prometheus.yml gives its static targets (tests/alert_jobs.py: an alert keyed on a job no
# target gets fails).
#   tests/prometheus_rules_test.sh [DEPLOY_DIR]   # default: deploy/prometheus of this checkout
# Without promtool it skips (exit 77), unless KVCM_REQUIRE_PROMETHEUS=1 (scripts/test.sh).
set -euo pipefail
dir=${1:-$(dirname "$0")/../deploy/prometheus}

if ! command -v promtool >/dev/null; then
  if [ "${KVCM_REQUIRE_PROMETHEUS:-0}" = 1 ]; then
    echo "promtool not found and KVCM_REQUIRE_PROMETHEUS=1 (apt-get install prometheus)" >&2
    exit 1
  fi
  echo "promtool not found: skipping" >&2
  exit 77
fi

promtool check config "$dir/prometheus.yml"
promtool check rules "$dir/kvcm-alerts.yaml"
promtool test rules "$dir/kvcm-alerts_test.yaml"
python3 "$(dirname "$0")/alert_jobs.py" static "$dir"
