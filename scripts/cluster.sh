#!/usr/bin/env bash
# A three-agent cluster on one machine, and a prompt served from another agent's cache: one
# kvcm-manager and kvcm-agents gpu-0, gpu-1, gpu-2 (host pools, TCP transport) on loopback;
# a prompt cached on gpu-0; Route ranks gpu-0 first, and between gpu-1 and gpu-2 plans a
# fetch; `kvcmctl fetch` moves the blocks to gpu-1; Match from gpu-1 shows the new replica.
#   ./scripts/cluster.sh [BUILD_DIR]
# BUILD_DIR (argument or environment): where kvcm-manager, kvcm-agent and kvcmctl were built;
# default build/release, as ./scripts/run.sh builds them. PORT: the manager's port (default:
# a free one). Every process started here is killed on exit, however the script exits; each
# wait gives up after 30 s. Exits non-zero when a step does not show what it should.
set -euo pipefail
build=${1:-${BUILD_DIR:-build/release}}
for bin in server/kvcm-manager gpu/agent/kvcm-agent client/kvcmctl; do
  if [ ! -x "$build/$bin" ]; then
    echo "cluster.sh: no $build/$bin (run ./scripts/run.sh, or pass the build directory)" >&2
    exit 1
  fi
done
port=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
logs=$(mktemp -d)
pids=()

cleanup() {
  local status=$?
  for pid in "${pids[@]}"; do kill -9 "$pid" 2> /dev/null || true; done
  wait 2> /dev/null || true
  if [ "$status" -ne 0 ]; then
    for log in "$logs"/*.log; do echo "--- $log ---" && cat "$log"; done >&2
  fi
  rm -rf "$logs"
}
trap cleanup EXIT

ctl() { "$build/client/kvcmctl" --insecure --manager_address="127.0.0.1:$port" "$@"; }
# Retries a command every 0.1 s until it succeeds; fails after 30 s.
until_ok() {
  local give_up=$((SECONDS + 30))
  until "$@" > /dev/null 2>&1; do
    if [ "$SECONDS" -ge "$give_up" ]; then
      echo "cluster.sh: gave up waiting for: $*" >&2
      return 1
    fi
    sleep 0.1
  done
}
three_alive() { [ "$(ctl stats | grep -c ' alive ')" = 3 ]; }
# Runs a kvcmctl command, shows it and its output, and checks that the output has `want`.
step() {
  local want=$1
  shift
  echo "\$ kvcmctl $*"
  ctl "$@" | tee "$logs/out"
  if ! grep -q -- "$want" "$logs/out"; then
    echo "cluster.sh: expected '$want' in the output of 'kvcmctl $1'" >&2
    return 1
  fi
  echo
}

"$build/server/kvcm-manager" --insecure --listen_address="127.0.0.1:$port" --metrics_address= \
  > "$logs/manager.log" 2>&1 &
pids+=($!)
until_ok ctl --deadline_ms=500 stats
for i in 0 1 2; do
  "$build/gpu/agent/kvcm-agent" --insecure --agent_id="gpu-$i" --manager_address="127.0.0.1:$port" \
    --listen_address=127.0.0.1:0 --data_listen_address=127.0.0.1:0 --use_device=false \
    --model=deepseek-v3 --capacity_bytes=300000000 --heartbeat_interval_ms=200 \
    > "$logs/gpu-$i.log" 2>&1 &
  pids+=($!)
done
until_ok three_alive
echo "manager on 127.0.0.1:$port, agents gpu-0 gpu-1 gpu-2 alive"
echo

prompt=(--tenant=acme --model=deepseek-v3 --random_tokens=300 --seed=7)  # 4 pages of 64
ctl register-model --tenant=acme --model=deepseek-v3 --preset=deepseek-v3 > /dev/null
step "new_pages: 4" insert "${prompt[@]}" --agent=gpu-0
step "chosen_agent: gpu-0" route "${prompt[@]}"
step "rank 1: gpu-1 cached_pages=0 fetch_pages=4" route "${prompt[@]}" --candidates=gpu-1,gpu-2
step "fetched_pages: 4" fetch "${prompt[@]}" --agent=gpu-1
step "gpu-0:gpu blocks" match "${prompt[@]}" --agent=gpu-1
grep -q "local_pages: 4" "$logs/out" && grep -q "^  gpu-1:gpu blocks" "$logs/out"
echo "\$ kvcmctl fetch ${prompt[*]} --agent=gpu-1   # again: nothing to do"
status=0
ctl fetch "${prompt[@]}" --agent=gpu-1 2>&1 || status=$?
echo "(exit $status)"
[ "$status" = 1 ]
