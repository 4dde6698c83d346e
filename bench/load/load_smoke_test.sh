#!/bin/bash
# kvcm_load_smoke: starts a kvcm-manager on a free loopback port (port 0, read back from its
# "listening on" line), runs kvcm-load --smoke against it (exit 1 on any error or no
# calls), and stops the manager.
# Usage: load_smoke_test.sh KVCM_MANAGER KVCM_LOAD
set -euo pipefail
manager=$1
load=$2
dir=$(mktemp -d)
pid=
cleanup() {
  if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT

: >"$dir/out"  # exists before the manager's shell opens it: the loop below reads it at once
"$manager" --listen_address=127.0.0.1:0 --metrics_address= --insecure >"$dir/out" 2>"$dir/err" &
pid=$!
address=
for _ in $(seq 100); do
  address=$(sed -n 's/^kvcm-manager listening on \([^ ]*\) .*/\1/p' "$dir/out" || true)
  [[ -n $address ]] && break
  kill -0 "$pid" 2>/dev/null || { cat "$dir/err" >&2; echo "kvcm-manager exited" >&2; exit 1; }
  sleep 0.1
done
[[ -n $address ]] || { cat "$dir/err" >&2; echo "kvcm-manager did not start" >&2; exit 1; }
"$load" --smoke --address="$address" --manager_pid="$pid" --report_interval_s=1 \
  --json="$dir/load.json"
# The JSON agrees: calls in the measured window, none failed.
grep -Eq '"results":\{"seconds":[0-9.]+,"calls":[1-9][0-9]*,"calls_per_s":[0-9.]+,"errors":0,' \
  "$dir/load.json"
