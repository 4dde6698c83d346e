// AgentMetrics: the Prometheus metrics of kvcm-agent (prefix kvcm_agent_). A registry with the
// BlockAgent RPC metrics, which the RpcRunner records into whether or not /metrics is served,
// and a collector that reads the pools and the registration state at scrape time. It never
// creates an HTTP exposer: Agent does, and registers collectables() with it.
//
// Thread-safe: recording and scraping may run concurrently from any thread.
#ifndef KVCM_GPU_AGENT_SERVER_AGENT_METRICS_H_
#define KVCM_GPU_AGENT_SERVER_AGENT_METRICS_H_

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc_metrics.h"
#include "common/rpc_runner.h"
#include "gpu/agent/control/room_maker.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/transport/data_port_counters.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcm {

// The BlockAgent RPCs, as the `rpc` label of the agent's RPC metrics.
enum class AgentRpc : int {
  kAllocate,
  kFree,
  kWriteBlocks,
  kReadBlocks,
  kRunAttention,
  kStats,
  kFetch,
};
inline constexpr int kNumAgentRpcs = 7;
absl::string_view RpcName(AgentRpc rpc);

using AgentRpcRecorder = PrometheusRpcRecorder<AgentRpc, kNumAgentRpcs>;

class AgentMetrics {
 public:
  // `pools` and `epoch` must outlive every scrape of collectables(); not owned.
  AgentMetrics(std::string agent_id, AgentPools pools, const AgentEpoch* epoch);
  ~AgentMetrics();
  AgentMetrics(const AgentMetrics&) = delete;
  AgentMetrics& operator=(const AgentMetrics&) = delete;

  // Where the BlockAgent's RpcRunner records: kvcm_agent_rpc_requests_total{rpc,code} and,
  // for unary calls, kvcm_agent_rpc_duration_seconds{rpc}.
  AgentRpcRecorder* rpcs() { return rpcs_.get(); }

  // One pull of blocks from a peer ended with `status`, having moved `bytes` in `elapsed`:
  // kvcm_transfer_bytes_total and kvcm_transfer_seconds on success,
  // kvcm_transfer_failures_total{reason=<code>} otherwise.
  // A successful pull also moves pull_gbps().
  void RecordTransfer(const absl::Status& status, uint64_t bytes, absl::Duration elapsed);

  // The local data path (local_socket_server.h): kvcm_agent_local_sessions_total{result}, for
  // a session whose hello registered a region ("opened"), a connection closed as it was
  // accepted ("refused": over local_max_sessions; "uid_limit"; "not_allowed"), one closed
  // without a hello in time ("hello_timeout") and a session whose token was revoked
  // ("revoked").
  void RecordLocalSession(absl::string_view result);
  // One LocalCopy in `direction` ("load" / "store") ended with `status`, having copied
  // `bytes`: kvcm_agent_local_copies_total{direction,code} and
  // kvcm_agent_local_bytes_total{direction}.
  void RecordLocalCopy(absl::string_view direction, const absl::Status& status, uint64_t bytes);

  // Stores into a full pool (RoomMaker): an allocation served after the manager made room
  // counts in kvcm_agent_room_allocations_total, its wait in kvcm_agent_room_wait_seconds
  // and the pages evicted for it in kvcm_agent_room_evicted_pages_total; a failed
  // allocation in kvcm_agent_allocation_failures_total{reason} (AllocationFailureName).
  RoomMakerObserver room_maker_observer();

  // Where the data port counts what it did with accepted connections
  // (TcpTransportOptions::counters), exported at scrape time as
  // kvcm_agent_data_connections_accepted_total, kvcm_agent_data_connections_served_total and
  // kvcm_agent_data_connections_closed_total{reason}.
  std::shared_ptr<DataPortCounters> data_port_counters() const { return data_port_; }

  // Bandwidth of recent successful pulls, Gbit/s: a moving average with weight 1/8 per pull
  // (as TCP smooths its RTT), 0 before the first. Heartbeats report it for Route.
  double pull_gbps() const;

  // What an exposer should serve: the RPC registry and the pool collector.
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables() const;

  // Every metric in the Prometheus text exposition format (what /metrics serves).
  std::string RenderText() const;

 private:
  class PoolCollector;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<DataPortCounters> data_port_;
  std::shared_ptr<PoolCollector> pool_collector_;
  std::unique_ptr<AgentRpcRecorder> rpcs_;
  prometheus::Counter* transfer_bytes_ = nullptr;
  prometheus::Histogram* transfer_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* transfer_failures_ = nullptr;
  prometheus::Family<prometheus::Counter>* local_sessions_ = nullptr;
  prometheus::Family<prometheus::Counter>* local_copies_ = nullptr;
  prometheus::Family<prometheus::Counter>* local_bytes_ = nullptr;
  prometheus::Counter* room_allocations_ = nullptr;
  prometheus::Counter* room_evicted_pages_ = nullptr;
  prometheus::Histogram* room_wait_seconds_ = nullptr;
  std::array<prometheus::Counter*, kNumAllocationFailures> allocation_failures_{};
  mutable absl::Mutex pull_mu_;
  double pull_gbps_ ABSL_GUARDED_BY(pull_mu_) = 0;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_AGENT_METRICS_H_
