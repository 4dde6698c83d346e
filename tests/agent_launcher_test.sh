#!/usr/bin/env bash
# ctest agent_launcher_test: deploy/kvcm-agent-launcher without a GPU (KVCM_GPUS stands in
# for nvidia-smi).
#  1. A fake kvcm-agent that records its arguments: one agent per GPU with its device index,
#     id, ports (stride 10) and pool (POOL_GPU_FRACTION of the GPU); SIGTERM reaches every
#     agent; an agent killed is restarted alone (the others keep their pids) and `--alive`
#     covers it while it restarts; an agent that keeps exiting (KVCM_MAX_RESTARTS) takes the
#     others and the launcher down with its status; a node with fewer GPUs than GPUS_PER_NODE
#     is refused.
#  2. The real kvcm-agent (host memory, plaintext) under the launcher against a real
#     kvcm-manager on loopback: `--check` fails until both agents are registered, then
#     passes, and kvcmctl stats lists both agent ids; an agent killed registers again.
#   tests/agent_launcher_test.sh KVCM_MANAGER KVCMCTL KVCM_AGENT
set -euo pipefail
manager_bin=$1 ctl_bin=$2 agent_bin=$3
tests_dir=$(cd "$(dirname "$0")" && pwd)
launcher=$tests_dir/../deploy/kvcm-agent-launcher
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  for f in "$work"/*.log; do [ -f "$f" ] && { echo "== $f"; tail -20 "$f"; }; done >&2
  echo "FAIL: $*" >&2
  exit 1
}
wait_for() {  # wait_for SECONDS COMMAND...
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

# --- 1. the fake agent --------------------------------------------------------------------
cat > "$work/fake-agent" <<'EOF'
#!/usr/bin/env bash
# Records its arguments in $FAKE_DIR/<agent id>.args and its pid in <agent id>.pid (one
# line per start), then waits; SIGTERM is recorded.
id=unknown
for a in "$@"; do case $a in --agent_id=*) id=${a#--agent_id=};; esac; done
printf '%s\n' "$@" > "$FAKE_DIR/$id.args"
echo $$ >> "$FAKE_DIR/$id.pid"
trap 'echo term > "$FAKE_DIR/$id.term"; exit 0' TERM
if [ "$id" = "${FAKE_EXIT_ID:-}" ]; then sleep 0.5; exit 3; fi
while :; do sleep 0.1; done
EOF
chmod +x "$work/fake-agent"
export FAKE_DIR=$work/fake KVCM_AGENT_BIN=$work/fake-agent KVCM_AGENT_NAME=kvcm-agent-x1y2z
export KVCM_LAUNCHER_STATE_DIR=$work/state
mkdir -p "$FAKE_DIR"

KVCM_GPUS="0:81920,1:143771" HOST_CAPACITY_BYTES=1000 KVCM_ADVERTISE_HOST=kvcm-agent-x1y2z.kvcm-agent.kvcm.svc \
  "$launcher" --model=deepseek-v3 --insecure > "$work/launcher1.log" 2>&1 &
launcher_pid=$!
pids+=("$launcher_pid")
wait_for 10 test -f "$FAKE_DIR/kvcm-agent-x1y2z-gpu1.args" -a -f "$FAKE_DIR/kvcm-agent-x1y2z-gpu0.args" ||
  fail "the launcher did not start two agents"
expect_args() {  # expect_args ID LINE...: each LINE is one of ID's arguments
  local id=$1; shift
  for line in "$@"; do
    grep -qxF -- "$line" "$FAKE_DIR/$id.args" || fail "$id lacks '$line': $(tr '\n' ' ' < "$FAKE_DIR/$id.args")"
  done
}
# 0.25 of 81920 MiB and of 143771 MiB; the host pool split in two.
expect_args kvcm-agent-x1y2z-gpu0 --device_index=0 --listen_address=0.0.0.0:50052 \
  --data_listen_address=0.0.0.0:50053 --metrics_address=0.0.0.0:9465 \
  --capacity_bytes=21474836480 --host_capacity_bytes=500 \
  --advertise_host=kvcm-agent-x1y2z.kvcm-agent.kvcm.svc --model=deepseek-v3 --insecure
expect_args kvcm-agent-x1y2z-gpu1 --device_index=1 --listen_address=0.0.0.0:50062 \
  --data_listen_address=0.0.0.0:50063 --metrics_address=0.0.0.0:9475 \
  --capacity_bytes=37688705024 --host_capacity_bytes=500 --model=deepseek-v3
kill -TERM $launcher_pid
status=0; wait $launcher_pid || status=$?
[ $status = 0 ] || fail "launcher exited $status on SIGTERM"
pids=()  # waited for: its pid may be reused
for i in 0 1; do
  [ -f "$FAKE_DIR/kvcm-agent-x1y2z-gpu$i.term" ] || fail "gpu$i's agent got no SIGTERM"
done
echo "ok: two agents, their flags, SIGTERM forwarded"

# One agent killed: restarted alone after the backoff; the other keeps its process.
rm -f "$FAKE_DIR"/*
KVCM_GPUS="0:1024,1:1024" KVCM_RESTART_BACKOFF_S=0.2 "$launcher" > "$work/launcher2.log" 2>&1 &
launcher_pid=$!
pids+=("$launcher_pid")
wait_for 10 test -f "$FAKE_DIR/kvcm-agent-x1y2z-gpu0.pid" -a -f "$FAKE_DIR/kvcm-agent-x1y2z-gpu1.pid" ||
  fail "the launcher did not start two agents"
gpu0_pid=$(cat "$FAKE_DIR/kvcm-agent-x1y2z-gpu0.pid")
gpu1_pid=$(cat "$FAKE_DIR/kvcm-agent-x1y2z-gpu1.pid")
kill -KILL "$gpu1_pid"
starts() { wc -l < "$FAKE_DIR/$1.pid"; }  # starts ID: how many times ID's agent started
restarted() { [ "$(starts kvcm-agent-x1y2z-gpu1)" = 2 ]; }
wait_for 10 restarted ||
  fail "gpu1's agent was not restarted: $(cat "$work/launcher2.log")"
new_gpu1_pid=$(tail -1 "$FAKE_DIR/kvcm-agent-x1y2z-gpu1.pid")
[ "$new_gpu1_pid" != "$gpu1_pid" ] && kill -0 "$new_gpu1_pid" || fail "gpu1's agent is not running again"
[ "$(cat "$FAKE_DIR/kvcm-agent-x1y2z-gpu0.pid")" = "$gpu0_pid" ] && kill -0 "$gpu0_pid" ||
  fail "gpu0's agent was restarted too: pids $(tr '\n' ' ' < "$FAKE_DIR/kvcm-agent-x1y2z-gpu0.pid")"
[ ! -f "$FAKE_DIR/kvcm-agent-x1y2z-gpu0.term" ] || fail "gpu0's agent got SIGTERM"
grep -q "GPU 1's agent exited (status 137); restarting it in 0.2s" "$work/launcher2.log" ||
  fail "no restart logged: $(cat "$work/launcher2.log")"
# The fake agents serve no /metrics: alive only within the grace of their (re)start.
KVCM_GPUS="0:1024,1:1024" "$launcher" --alive || fail "--alive failed within the start grace"
if KVCM_GPUS="0:1024,1:1024" KVCM_AGENT_START_GRACE_S=0 "$launcher" --alive > /dev/null; then
  fail "--alive passed for agents that never answered"
fi
kill -TERM $launcher_pid
status=0; wait $launcher_pid || status=$?
[ $status = 0 ] || fail "launcher exited $status on SIGTERM after a restart"
pids=()
echo "ok: a killed agent is restarted alone, the other keeps its pid"

# An agent that keeps exiting: after KVCM_MAX_RESTARTS restarts the launcher gives up.
rm -f "$FAKE_DIR"/*
status=0
FAKE_EXIT_ID=kvcm-agent-x1y2z-gpu1 KVCM_GPUS="0:1024,1:1024" KVCM_MAX_RESTARTS=2 \
  KVCM_RESTART_BACKOFF_S=0.1 timeout 20 "$launcher" > "$work/launcher3.log" 2>&1 || status=$?
[ $status = 3 ] || fail "launcher exited $status after a crash-looping agent exited 3 (want 3)"
[ "$(starts kvcm-agent-x1y2z-gpu1)" = 3 ] ||
  fail "gpu1's agent started $(starts kvcm-agent-x1y2z-gpu1) times (want 1 + 2 restarts)"
[ "$(starts kvcm-agent-x1y2z-gpu0)" = 1 ] || fail "gpu0's agent was restarted"
[ -f "$FAKE_DIR/kvcm-agent-x1y2z-gpu0.term" ] || fail "the surviving agent was not stopped"
grep -q "GPU 1's agent exited 3 times in a row" "$work/launcher3.log" ||
  fail "no crash loop logged: $(cat "$work/launcher3.log")"
echo "ok: a crash-looping agent stops the other and the launcher (status 3) after 2 restarts"

status=0
out=$(GPUS_PER_NODE=8 KVCM_GPUS="0:1024,1:1024" "$launcher" 2>&1) || status=$?
[ $status = 1 ] && grep -q "GPUS_PER_NODE=8 but this node has 2 GPU(s)" <<< "$out" ||
  fail "GPUS_PER_NODE=8 on two GPUs: status $status, $out"
status=0
out=$(KVCM_GPUS="0:1024" POOL_GPU_FRACTION=1.5 "$launcher" 2>&1) || status=$?
[ $status = 1 ] && grep -q "POOL_GPU_FRACTION '1.5'" <<< "$out" || fail "fraction 1.5 accepted: $out"
echo "ok: too few GPUs and a bad fraction refused"

# --- 2. the real agent and manager --------------------------------------------------------
# A base port p with p..p+2 and p+10..p+12 free: BlockAgent p, data p+1, metrics p+2 (agent 1
# adds 10), all distinct.
free_base() {
  python3 - <<'PY'
import random, socket
while True:
    p = random.randrange(20000, 31980)
    try:
        for port in (p, p + 1, p + 2, p + 10, p + 11, p + 12):
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
    except OSError:
        continue
    print(p)
    break
PY
}
manager_port=$(python3 "$tests_dir/free_port.py")
manager_metrics=$(python3 "$tests_dir/free_port.py")
base=$(free_base)
KVCM_BLOCKAGENT_PORT=$base KVCM_DATA_PORT=$((base + 1)) KVCM_METRICS_PORT=$((base + 2))
export KVCM_BLOCKAGENT_PORT KVCM_DATA_PORT KVCM_METRICS_PORT
export KVCM_LISTEN_HOST=127.0.0.1 KVCM_METRICS_HOST=127.0.0.1 KVCM_AGENT_BIN=$agent_bin
export KVCM_GPUS="0:256,1:256" KVCM_AGENT_NAME=launcher-test KVCM_RESTART_BACKOFF_S=0.2
unset KVCM_ADVERTISE_HOST

"$launcher" --manager_address=127.0.0.1:$manager_port --insecure --use_device=false \
  --heartbeat_interval_ms=200 > "$work/agents.log" 2>&1 &
pids+=($!)
launcher_pid=$!
# Both agents serve /metrics, but with no manager neither is registered: not ready.
wait_for 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$((KVCM_METRICS_PORT + 10))" 2> /dev/null ||
  fail "agent 1's metrics port never opened"
if "$launcher" --check > "$work/check.log" 2>&1; then fail "--check passed with no manager"; fi
grep -q "is not registered" "$work/check.log" || fail "--check: $(cat "$work/check.log")"

"$manager_bin" --insecure --listen_address=127.0.0.1:$manager_port \
  --metrics_address=127.0.0.1:$manager_metrics > "$work/manager.log" 2>&1 &
pids+=($!)
wait_for 60 "$launcher" --check > /dev/null 2>&1 || fail "--check never passed: $("$launcher" --check 2>&1)"
# GPUS_PER_NODE counts the agents without discovery; one more than runs is not ready.
GPUS_PER_NODE=2 KVCM_GPUS=bad "$launcher" --check || fail "--check with GPUS_PER_NODE=2 failed"
if GPUS_PER_NODE=3 "$launcher" --check > /dev/null; then fail "--check passed for a third agent"; fi
stats=$("$ctl_bin" --insecure --addr=127.0.0.1:$manager_port stats 2>&1) || fail "kvcmctl stats: $stats"
for id in launcher-test-gpu0 launcher-test-gpu1; do
  grep -q "$id" <<< "$stats" || fail "kvcmctl stats lists no $id: $stats"
done
kill -0 $launcher_pid || fail "the launcher died"
"$launcher" --alive || fail "--alive failed with both agents up"
echo "ok: two real agents registered (--check passes, kvcmctl stats lists both)"

# A real agent killed comes back and registers again; the other keeps running.
agent_pid() { pgrep -P $launcher_pid -f -- "--agent_id=launcher-test-gpu$1"; }
gpu0_pid=$(agent_pid 0) gpu1_pid=$(agent_pid 1)
kill -KILL "$gpu1_pid"
wait_for 60 bash -c "! kill -0 $gpu1_pid 2> /dev/null" || fail "agent 1 did not die"
wait_for 60 "$launcher" --check > /dev/null 2>&1 ||
  fail "--check never passed after agent 1's restart: $("$launcher" --check 2>&1)"
[ "$(agent_pid 0)" = "$gpu0_pid" ] || fail "agent 0 was restarted too"
[ -n "$(agent_pid 1)" ] || fail "agent 1 is not running"
echo "ok: a killed real agent restarts and registers again, the other untouched"
kill -TERM $launcher_pid
status=0; wait $launcher_pid || status=$?
[ $status = 0 ] || fail "launcher exited $status on SIGTERM with real agents"
echo "PASS"
