#!/usr/bin/env bash
# ctest prometheus_scrape_test: a real prometheus scrapes a real kvcm-manager and two
# kvcm-agents (plaintext, free loopback ports) with the job names of
# deploy/prometheus/prometheus.yml and loads kvcm-alerts.yaml. kvcmctl then drives every path
# the dashboards show (two tenants, pins released and expired, misses, an error, evictions and
# a demotion, regret, expired pages, a pull between the agents, a failed pull from an agent
# that was killed, which the manager then declares gone). Afterwards every series the alert
# rules read must be in Prometheus, every rule must evaluate without error, and
# tests/dashboard_queries.py must find data for every query of every dashboard under
# deploy/grafana (and a rate > 0 for every counter it rates, except the few named --still).
#   tests/prometheus_scrape_test.sh KVCM_MANAGER KVCMCTL KVCM_AGENT [DEPLOY_DIR] [GRAFANA_DIR]
# The managers are two, electing a leader on a real etcd (the leader is driven, the standby
# only scraped), and a third on its own with the default policy, "select", whose choice the
# dashboards show (the leader runs "cost", which demotes). Without prometheus or etcd it skips (exit 77), unless
# KVCM_REQUIRE_PROMETHEUS=1 / KVCM_REQUIRE_ETCD=1 (scripts/test.sh).
set -euo pipefail
manager_bin=$1 ctl_bin=$2 agent_bin=$3
tests_dir=$(cd "$(dirname "$0")" && pwd)
deploy=$(cd "${4:-$(dirname "$0")/../deploy/prometheus}" && pwd)
grafana=$(cd "${5:-$deploy/../grafana}" && pwd)

if ! command -v prometheus >/dev/null; then
  if [ "${KVCM_REQUIRE_PROMETHEUS:-0}" = 1 ]; then
    echo "prometheus not found and KVCM_REQUIRE_PROMETHEUS=1 (apt-get install prometheus)" >&2
    exit 1
  fi
  echo "prometheus not found: skipping" >&2
  exit 77
fi

if ! command -v etcd >/dev/null; then
  if [ "${KVCM_REQUIRE_ETCD:-0}" = 1 ]; then
    echo "etcd not found and KVCM_REQUIRE_ETCD=1 (apt-get install etcd-server)" >&2
    exit 1
  fi
  echo "etcd not found: skipping" >&2
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

# A port nothing is bound to, below the ephemeral range (outgoing connections take ports there).
free_port() {
  python3 "$tests_dir/free_port.py"
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
  echo "--- standby.log" >&2; tail -20 "$work/standby.log" >&2 || true
  echo "--- select.log" >&2; tail -20 "$work/select.log" >&2 || true
  for log in "$work"/gpu-*.log; do echo "--- $(basename "$log")" >&2; tail -20 "$log" >&2; done
  echo "--- prometheus.log" >&2; tail -20 "$work/prometheus.log" >&2 || true
}

grpc_port=$(free_port) metrics_port=$(free_port) prom_port=$(free_port)
# The managers run as deployed: two of them electing a leader on etcd (the HA series and
# panels need both), with the hash secret from a file.
etcd_client=127.0.0.1:$(free_port) etcd_peer=http://127.0.0.1:$(free_port)
etcd --name=scrape --data-dir="$work/etcd" --listen-client-urls="http://$etcd_client" \
  --advertise-client-urls="http://$etcd_client" --listen-peer-urls="$etcd_peer" \
  --initial-advertise-peer-urls="$etcd_peer" --initial-cluster="scrape=$etcd_peer" \
  > "$work/etcd.log" 2>&1 &
pids+=($!)
wait_for 30 grep -q "ready to serve client requests" "$work/etcd.log" ||
  { echo "etcd never served" >&2; tail -20 "$work/etcd.log" >&2; exit 1; }
echo 00112233445566778899aabbccddeeff > "$work/hash_secret"
ha=(--etcd_endpoints=$etcd_client --etcd_lease_ttl_s=2 --hash_secret_file="$work/hash_secret")
# A short heartbeat timeout, so that the agent killed below is gone within the test; the cost
# policy, which demotes GPU pages into a HOST pool; quotas, so that the quota lines have a
# series.
"$manager_bin" --insecure --listen_address=127.0.0.1:$grpc_port \
  --metrics_address=127.0.0.1:$metrics_port --agent_heartbeat_timeout_ms=6000 --policy=cost \
  --tenant_max_bytes=1000000000000 --tenant_max_pinned_bytes=1000000000000 "${ha[@]}" \
  > "$work/manager.log" 2>&1 &
pids+=($!)
wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:$metrics_port/metrics" ||
  { echo "manager's metrics never answered" >&2; dump_logs; exit 1; }
wait_for 30 grep -q "election: leading" "$work/manager.log" ||
  { echo "the first manager never led" >&2; dump_logs; exit 1; }
# The standby: only /metrics, scraped under the same job.
standby_metrics_port=$(free_port)
"$manager_bin" --insecure --listen_address=127.0.0.1:$(free_port) \
  --metrics_address=127.0.0.1:$standby_metrics_port "${ha[@]}" > "$work/standby.log" 2>&1 &
pids+=($!)
wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:$standby_metrics_port/metrics" ||
  { echo "the standby's metrics never answered" >&2; dump_logs; exit 1; }
# The third: index-only pools of 100 MB (22 pages here), small enough to be simulated whole.
select_port=$(free_port) select_metrics_port=$(free_port)
"$manager_bin" --insecure --listen_address=127.0.0.1:$select_port \
  --metrics_address=127.0.0.1:$select_metrics_port --default_pool_capacity_bytes=100000000 \
  > "$work/select.log" 2>&1 &
pids+=($!)
wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:$select_metrics_port/metrics" ||
  { echo "the select manager's metrics never answered" >&2; dump_logs; exit 1; }

# gpu-0 and gpu-1; gpu-1 has a HOST pool, so that evicting from its GPU pool demotes.
declare -A agent_pid agent_metrics_port
start_agent() {
  local id=$1; shift
  agent_metrics_port[$id]=$(free_port)
  "$agent_bin" --insecure --agent_id="$id" --manager_address=127.0.0.1:$grpc_port \
    --listen_address=127.0.0.1:$(free_port) --data_listen_address=127.0.0.1:$(free_port) \
    --model=deepseek-v3 --capacity_bytes=300000000 --heartbeat_interval_ms=500 \
    --metrics_address=127.0.0.1:${agent_metrics_port[$id]} "$@" > "$work/$id.log" 2>&1 &
  agent_pid[$id]=$!
  pids+=($!)
}
start_agent gpu-0
start_agent gpu-1 --host_capacity_bytes=100000000
for id in gpu-0 gpu-1; do
  wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:${agent_metrics_port[$id]}/metrics" ||
    { echo "$id's metrics never answered" >&2; dump_logs; exit 1; }
done

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
      - targets: ["127.0.0.1:$metrics_port", "127.0.0.1:$standby_metrics_port", "127.0.0.1:$select_metrics_port"]
  - job_name: kvcm-agent
    static_configs:
      - targets: ["127.0.0.1:${agent_metrics_port[gpu-0]}", "127.0.0.1:${agent_metrics_port[gpu-1]}"]
YAML
grep -q '^  - job_name: kvcm-manager$' "$deploy/prometheus.yml"
grep -q '^  - job_name: kvcm-agent$' "$deploy/prometheus.yml"
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address=127.0.0.1:$prom_port > "$work/prometheus.log" 2>&1 &
pids+=($!)

# has_series QUERY: the instant query returns at least one sample.
has_series() {
  curl -sf --get "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1" |
    python3 -c 'import json, sys; r = json.load(sys.stdin); sys.exit(not (r["status"] == "success" and r["data"]["result"]))' 2>/dev/null
}

ctl=("$ctl_bin" --insecure --manager_address=127.0.0.1:$grpc_port)
acme=(--tenant=acme --model=dsv3) beta=(--tenant=beta --model=dsv3) short=(--tenant=beta --model=short)
geometry=(--attention=mla --num_layers=61 --num_heads=128 --kv_lora_rank=512 --rope_dim=64
  --kv_dtype=bf16 --page_size_tokens=64)
run() { "${ctl[@]}" "$@" > "$work/ctl.out" 2>&1 || { cat "$work/ctl.out" >&2; return 1; }; }
pin_id() { sed -n 's/^pin_id: //p' "$work/ctl.out"; }
run register-model "${acme[@]}" "${geometry[@]}"
run register-model "${beta[@]}" "${geometry[@]}"
run register-model "${short[@]}" "${geometry[@]}" --max_page_age_s=1  # expires at the sweep
not_found() {
  if run match --tenant=nobody --model=dsv3 --random_tokens=300 --seed=7 2>/dev/null; then
    echo "a match in an unregistered namespace succeeded" >&2; exit 1
  fi
}
not_found
# Every target scraped once before the load, with the namespaces' series and the NOT_FOUND
# series already there: rate() needs two different samples of a series, so a counter must
# have a sample from before it moved.
wait_for 30 has_series 'count(up == 1) == 5 and on() count(kvcm_namespace_requested_tokens_total) == 3 and on() count(kvcm_rpc_requests_total{code="NOT_FOUND"}) == 1' ||
  { echo "prometheus never scraped all four targets" >&2
    for q in 'up' 'count(kvcm_namespace_requested_tokens_total)' 'kvcm_rpc_requests_total{code="NOT_FOUND"}'; do
      curl -s --get "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$q" >&2; echo >&2
    done
    dump_logs; exit 1; }
not_found
run insert "${acme[@]}" --random_tokens=300 --seed=7 --agent=gpu-0
run insert "${acme[@]}" --random_tokens=300 --seed=9 --agent=gpu-0
run insert "${acme[@]}" --random_tokens=300 --seed=13 --agent=gpu-0
run insert "${beta[@]}" --random_tokens=300 --seed=11 --agent=gpu-1
run match "${acme[@]}" --random_tokens=300 --seed=7 --agent=gpu-1 --pin  # held to the end
run match "${acme[@]}" --random_tokens=300 --seed=7 --pin --lease_ttl_ms=200  # lapses
run match "${acme[@]}" --random_tokens=300 --seed=9 --pin
run release "${acme[@]}" --pin_id="$(pin_id)"
run match "${acme[@]}" --random_tokens=300 --seed=8 --agent=gpu-1  # a miss
run match "${beta[@]}" --random_tokens=300 --seed=11
run match "${beta[@]}" --random_tokens=300 --seed=12
# gpu-1 pulls seed 7's pages from gpu-0 over loopback TCP.
run fetch "${acme[@]}" --random_tokens=300 --seed=7 --agent=gpu-1
# Evicts unpinned pages (seeds 9 and 13) from gpu-0; gpu-1 demotes into its HOST pool.
run evict --agent=gpu-0 --tier=gpu --bytes=20000000
run evict --agent=gpu-1 --tier=gpu --bytes=1
run insert "${short[@]}" --random_tokens=300 --seed=5 --agent=gpu-1  # expires in 1 s
# Asking again for evicted pages within the regret window is regret.
run match "${acme[@]}" --random_tokens=300 --seed=9
run match "${acme[@]}" --random_tokens=300 --seed=13
# The select manager serves two prompts twice as a worker would (a match by the pool's
# agent, then an insert; the first match comes before the insert that makes the pool): its
# miniature caches miss, then hit.
select_run() {
  "$ctl_bin" --insecure --manager_address=127.0.0.1:$select_port "$@" > "$work/ctl.out" 2>&1 ||
    { cat "$work/ctl.out" >&2; return 1; }
}
select_run register-model "${acme[@]}" "${geometry[@]}"
for round in 1 2; do
  for seed in 21 22; do
    select_run match "${acme[@]}" --random_tokens=300 --seed=$seed --agent=gpu-9
    select_run insert "${acme[@]}" --random_tokens=300 --seed=$seed --agent=gpu-9
  done
done
# A pull from an agent that died fails (UNAVAILABLE), and the manager then declares it gone
# and drops its pages.
run insert "${acme[@]}" --random_tokens=300 --seed=15 --agent=gpu-0
# SIGKILL, a crash: an agent stopped with SIGTERM leaves, and the manager forgets it at once.
kill -KILL "${agent_pid[gpu-0]}"
wait "${agent_pid[gpu-0]}" 2>/dev/null || true
dead_pull() {
  if run fetch "${acme[@]}" --random_tokens=300 --seed=15 --agent=gpu-1 --from=gpu-0 2>/dev/null; then
    echo "a pull from a dead agent succeeded" >&2; exit 1
  fi
}
# Twice, with a scrape between: the first failure creates the series, the second moves it.
dead_pull
wait_for 10 has_series 'kvcm_transfer_failures_total{reason="UNAVAILABLE"} == 1' ||
  { echo "the failed pull was never counted" >&2; dump_logs; exit 1; }
dead_pull
wait_for 20 has_series 'kvcm_agents{state="gone"} == 1' ||
  { echo "the manager never declared gpu-0 gone" >&2; dump_logs; exit 1; }

queries=(
  'up{job="kvcm-manager"} == 1'
  'kvcm_manager_leader{job="kvcm-manager"} == 1'
  'kvcm_manager_leader{job="kvcm-manager"} == 0'
  'kvcm_etcd_requests_total{job="kvcm-manager", op="LeaseKeepAlive", code="OK"} > 0'
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
  'kvcm_pages_dropped_total{job="kvcm-manager"} > 0'
  'up{job="kvcm-agent"} == 1'
  'kvcm_agent_registered{job="kvcm-agent"} == 1'
  'kvcm_agent_rpc_requests_total{job="kvcm-agent"}'
  'kvcm_transfer_seconds_count{job="kvcm-agent"} > 0'
  'kvcm_transfer_failures_total{job="kvcm-agent", reason="UNAVAILABLE"} > 0'
  'sum(kvcm_policy_choice{job="kvcm-manager"}) == 1'
  'count(kvcm_policy_choice{job="kvcm-manager"}) == 5'
  'kvcm_policy_shadow_hit_ratio{job="kvcm-manager", candidate="lru"} > 0'
  'kvcm_policy_sampled_pages_total{job="kvcm-manager", kind="lookup"} > 0'
  'kvcm_policy_shadow_pages{job="kvcm-manager"} > 0'
  'kvcm_policy_min_sample_rate{job="kvcm-manager"} == 1'
)
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

# Every query of every dashboard. The manager's engine counters need an engine bridge
# (PublishEngineEvents), which kvcmctl has no command for; no WatchEvents subscriber falls
# behind here; no pool here is small enough for stores to make room (the full-pool series
# are still checked to exist with their labels).
python3 "$(dirname "$0")/dashboard_queries.py" --prometheus="http://127.0.0.1:$prom_port" \
  --dashboards="$grafana" --rate-interval=2m --wait-s=20 \
  --still=kvcm_engine_sessions_started_total='no engine bridge in this test' \
  --still=kvcm_engine_sessions_lapsed_total='no engine bridge in this test' \
  --still=kvcm_engine_pages_stored_total='no engine bridge in this test' \
  --still=kvcm_engine_pages_removed_total='no engine bridge in this test' \
  --still=kvcm_engine_sequence_refusals_total='no engine bridge in this test' \
  --still=kvcm_watch_overflows_total='no WatchEvents subscriber here' \
  --still=kvcm_agent_room_allocations_total='no store into a full pool here (full_pool_test)' \
  --still=kvcm_allocation_evicted_pages_total='no store into a full pool here (full_pool_test)' \
  --still=kvcm_agent_allocation_failures_total='no store fails here (full_pool_test)' \
  --still=kvcm_policy_moves_total='no move in a run this short (select_test moves it)' || status=1

if [ "$status" != 0 ]; then dump_logs; fi
exit "$status"
