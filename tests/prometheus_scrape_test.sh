#!/usr/bin/env bash
# ctest prometheus_scrape_test: a real prometheus scrapes a real kvcm-manager and
# kvcm-agent (plaintext, free loopback ports) with the job names of
# deploy/prometheus/prometheus.yml and loads kvcm-alerts.yaml; after a few kvcmctl calls, every series the alert rules read must be in
# Prometheus (asked through /api/v1/query) and every rule must evaluate without error.
#   tests/prometheus_scrape_test.sh KVCM_MANAGER KVCMCTL KVCM_AGENT [DEPLOY_DIR]
# Without prometheus it skips (exit 77), unless KVCM_REQUIRE_PROMETHEUS=1 (scripts/test.sh).
set -euo pipefail
manager_bin=$1 ctl_bin=$2 agent_bin=$3
deploy=$(cd "${4:-$(dirname "$0")/../deploy/prometheus}" && pwd)

if ! command -v prometheus >/dev/null; then
  if [ "${KVCM_REQUIRE_PROMETHEUS:-0}" = 1 ]; then
    echo "prometheus not found and KVCM_REQUIRE_PROMETHEUS=1 (apt-get install prometheus)" >&2
    exit 1
  fi
  echo "prometheus not found: skipping" >&2
  exit 77
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# wait_for SECONDS COMMAND...: retries COMMAND every 0.5 s until it succeeds or time runs out.
wait_for() {
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then return 1; fi
    sleep 0.5
  done
}
dump_logs() {
  echo "--- manager.log" >&2; tail -20 "$work/manager.log" >&2 || true
  echo "--- agent.log" >&2; tail -20 "$work/agent.log" >&2 || true
  echo "--- prometheus.log" >&2; tail -20 "$work/prometheus.log" >&2 || true
}

grpc_port=$(free_port) metrics_port=$(free_port) prom_port=$(free_port)
"$manager_bin" --insecure --listen_address=127.0.0.1:$grpc_port \
  --metrics_address=127.0.0.1:$metrics_port > "$work/manager.log" 2>&1 &
pids+=($!)
wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:$metrics_port/metrics" ||
  { echo "manager's metrics never answered" >&2; dump_logs; exit 1; }

agent_metrics_port=$(free_port)
"$agent_bin" --insecure --agent_id=gpu-0 --manager_address=127.0.0.1:$grpc_port \
  --listen_address=127.0.0.1:$(free_port) --data_listen_address=127.0.0.1:$(free_port) \
  --model=deepseek-v3 --capacity_bytes=300000000 \
  --metrics_address=127.0.0.1:$agent_metrics_port > "$work/agent.log" 2>&1 &
pids+=($!)
wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:$agent_metrics_port/metrics" ||
  { echo "agent's metrics never answered" >&2; dump_logs; exit 1; }

# The deployed scrape configuration's job names, a fast interval, and the deployed rules.
cat > "$work/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $deploy/kvcm-alerts.yaml
scrape_configs:
  - job_name: kvcm-manager
    static_configs:
      - targets: ["127.0.0.1:$metrics_port"]
  - job_name: kvcm-agent
    static_configs:
      - targets: ["127.0.0.1:$agent_metrics_port"]
YAML
grep -q '^  - job_name: kvcm-manager$' "$deploy/prometheus.yml"
grep -q '^  - job_name: kvcm-agent$' "$deploy/prometheus.yml"
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address=127.0.0.1:$prom_port > "$work/prometheus.log" 2>&1 &
pids+=($!)

ctl=("$ctl_bin" --insecure --addr=127.0.0.1:$grpc_port)
ns=(--tenant=acme --model=dsv3)
"${ctl[@]}" register-model "${ns[@]}" --attention=mla --layers=61 --heads=128 \
  --kv_lora_rank=512 --rope_dim=64 --dtype=bf16 --page_size=64 > /dev/null
"${ctl[@]}" insert "${ns[@]}" --random_tokens=300 --seed=7 --agent=gpu-0 > /dev/null
"${ctl[@]}" insert "${ns[@]}" --random_tokens=300 --seed=9 --agent=gpu-0 > /dev/null
"${ctl[@]}" match "${ns[@]}" --random_tokens=300 --seed=7 --agent=gpu-1 --pin > /dev/null
"${ctl[@]}" match "${ns[@]}" --random_tokens=300 --seed=8 --agent=gpu-1 > /dev/null
# Evicts seed 9's unpinned pages; seed 7's stay pinned.
"${ctl[@]}" evict --agent=gpu-0 --tier=gpu --bytes=1 > /dev/null

# has_series QUERY: the instant query returns at least one sample.
has_series() {
  curl -sf --get "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1" |
    python3 -c 'import json, sys; r = json.load(sys.stdin); sys.exit(not (r["status"] == "success" and r["data"]["result"]))'
}
queries=(
  'up{job="kvcm-manager"} == 1'
  'kvcm_agents{job="kvcm-manager", state="gone"}'
  'kvcm_pool_usage_ratio{job="kvcm-manager"}'
  'kvcm_pool_pinned_bytes{job="kvcm-manager"}'
  'kvcm_pool_capacity_bytes{job="kvcm-manager"}'
  'kvcm_eviction_regret_pages_total{job="kvcm-manager"}'
  'kvcm_pages_evicted_total{job="kvcm-manager"} > 0'
  'kvcm_requested_tokens_total{job="kvcm-manager"} > 0'
  'kvcm_matched_tokens_total{job="kvcm-manager"} > 0'
  'kvcm_rpc_requests_total{job="kvcm-manager", rpc="Match", code="OK"} > 0'
  'kvcm_rpc_duration_seconds_bucket{job="kvcm-manager", rpc="Match"}'
  'kvcm_lease_expiries_total{job="kvcm-manager"}'
  'kvcm_pins_taken_total{job="kvcm-manager"} > 0'
  'kvcm_agents{job="kvcm-manager", state="alive"} == 1'
  'up{job="kvcm-agent"} == 1'
  'kvcm_agent_registered{job="kvcm-agent"} == 1'
  'kvcm_agent_rpc_requests_total{job="kvcm-agent"}'
  'kvcm_transfer_seconds_count{job="kvcm-agent"}'
)
# kvcm_transfer_failures_total has a series per failure reason only once a pull has failed.
status=0
for q in "${queries[@]}"; do
  if wait_for 30 has_series "$q"; then echo "ok   $q"; else echo "MISSING $q" >&2; status=1; fi
done

# Every rule loaded and evaluated without error.
rules_ok() {
  curl -sf "http://127.0.0.1:$prom_port/api/v1/rules" | python3 -c '
import json, sys
rules = [r for g in json.load(sys.stdin)["data"]["groups"] for r in g["rules"]]
bad = [r["name"] for r in rules if r.get("health") != "ok"]
print(len(rules), "rules, not ok:", bad)
sys.exit(not rules or bool(bad))'
}
wait_for 20 rules_ok || { echo "some alert rule did not evaluate" >&2; status=1; }

if [ "$status" != 0 ]; then dump_logs; fi
exit "$status"
