#!/usr/bin/env bash
# Runs a README command block as written: the fenced block after the line
# "<!-- demo: NAME -->", in a scratch directory, with B (the build directory), PORT (a free
# loopback port) and REPO (the README's directory) set. Fails when the block fails or takes
# longer than $DEMO_TIMEOUT_S seconds (default 120).
#   tests/readme_demo_test.sh README.md restart BUILD_DIR
set -euo pipefail
readme=$1 name=$2 build=$(cd "$3" && pwd) repo=$(cd "$(dirname "$1")" && pwd)

block=$(awk -v marker="<!-- demo: $name -->" '
  $0 == marker { found = 1; next }
  found && /^```/ { if (inside) exit; inside = 1; next }
  inside { print }' "$readme")
if [ -z "$block" ]; then
  echo "no block after <!-- demo: $name --> in $readme" >&2
  exit 1
fi

scratch=$(mktemp -d)
cleanup() {
  # Whatever the block left running (it ends by killing its own processes).
  pkill -KILL -P $$ 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT
port=$(python3 "$repo/tests/free_port.py")
cd "$scratch"
printf '%s\n' "$block" > demo.sh
B="$build" PORT="$port" REPO="$repo" timeout --kill-after=5 "${DEMO_TIMEOUT_S:-120}" bash -euo pipefail demo.sh || {
  status=$?
  for log in *.log; do echo "--- $log ---"; cat "$log"; done
  exit $status
}
