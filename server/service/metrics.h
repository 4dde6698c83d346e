// Prometheus metrics of the manager (prefix kvcm_; see docs in ARCHITECTURE.md section 7).
//
// ServiceMetrics owns a prometheus::Registry with the RPC metrics, plus a Collectable that
// snapshots CacheIndex::Stats() at scrape time (pool bytes, namespace and tenant sizes, the
// index's counters, hit ratio, policy "select"'s choice, build info) and the AgentRegistry
// (agents alive/suspect/gone, each agent's heartbeat age and epoch). It never creates an HTTP
// exposer: ManagerServer does, and registers collectables() with it. Thread-safe.
#ifndef KVCM_SERVER_SERVICE_METRICS_H_
#define KVCM_SERVER_SERVICE_METRICS_H_

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/rpc_metrics.h"
#include "common/rpc_runner.h"
#include "google/protobuf/descriptor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/core/engine_sessions.h"
#include "server/service/event_hub.h"

namespace kvcm {

// The CacheManager and AgentControl RPCs, as the `rpc` label of the RPC metrics: every
// method of the two services in their .proto order, but AgentControl.Commands (see
// LabelledMethods). Labels and streaming come from the descriptors; metrics_test checks this
// enum against them, so a new RPC fails there until it has its entry here.
enum class Rpc : int {
  kRegisterModel,
  kMatch,
  kInsert,
  kRelease,
  kRenewLease,
  kRoute,
  kEvict,
  kReserve,
  kUnreserve,
  kStats,
  kWatchEvents,
  kDeleteNamespace,
  kPublishEngineEvents,
  kForgetAgent,
  // AgentControl.
  kRegisterAgent,
  kHeartbeat,
  kReportInventory,
  kNcclBootstrap,
  kLookupAgent,
  kMakeRoom,
};
inline constexpr int kNumRpcs = 20;
// The method's name, but "RegisterAgent" for AgentControl.Register (the label dashboards
// know); "unknown" past the described methods.
absl::string_view RpcName(Rpc rpc);
// The methods that have an `rpc` label, in Rpc order: those of CacheManager then
// AgentControl, less AgentControl.Commands (a stream as long as its agent's epoch, whose
// commands kvcm_agent_commands_total counts).
const std::vector<const google::protobuf::MethodDescriptor*>& LabelledMethods();

// Outcome of one manager -> agent command, as the `result` label of
// kvcm_agent_commands_total.
enum class AgentCommandResult : int {
  kAcked,    // the agent executed it (ack code OK)
  kFailed,   // the agent answered an error
  kDropped,  // never sent: the agent's queue was full or its stream closed first
};
inline constexpr int kNumAgentCommandResults = 3;

// Most namespaces exported with their own (tenant, model) labels; the rest are summed into
// one series labelled kOtherLabel, so /metrics stays bounded whatever clients register.
inline constexpr size_t kMaxNamespaceSeries = 256;
inline constexpr absl::string_view kOtherLabel = "_other";
// The tenant label of tenant "" (the operators' reservations).
inline constexpr absl::string_view kOperatorTenantLabel = "_operator";

// Version reported by kvcm_build_info.
absl::string_view KvcmVersion();

class ServiceMetrics final : public RpcMetricsRecorder<Rpc> {
 public:
  // `index`, `hub` and `agents` (when not null) must outlive every scrape of
  // collectables(); not owned. Without `agents` the agent metrics are absent.
  ServiceMetrics(const CacheIndex* index, const EventHub* hub,
                 const AgentRegistry* agents = nullptr, const EngineSessions* engines = nullptr);
  ~ServiceMetrics() override;
  ServiceMetrics(const ServiceMetrics&) = delete;
  ServiceMetrics& operator=(const ServiceMetrics&) = delete;

  // One finished call: kvcm_rpc_requests_total{rpc,code} += 1 and, for unary calls,
  // kvcm_rpc_duration_seconds{rpc} observes `latency`.
  void RecordRpc(Rpc rpc, absl::StatusCode code, absl::Duration latency) override {
    rpcs_->RecordRpc(rpc, code, latency);
  }
  // A finished streaming call: only kvcm_rpc_requests_total.
  void RecordStreamEnd(Rpc rpc, absl::StatusCode code) override {
    rpcs_->RecordStreamEnd(rpc, code);
  }
  // kvcm_agent_commands_total{result} += 1.
  void RecordAgentCommand(AgentCommandResult result);

  // What an exposer should serve: the RPC registry and the index snapshot collector.
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables() const;

  // Every metric in the Prometheus text exposition format (what /metrics serves).
  std::string RenderText() const;

 private:
  class IndexCollector;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<IndexCollector> index_collector_;
  std::unique_ptr<PrometheusRpcRecorder<Rpc, kNumRpcs>> rpcs_;
  std::array<prometheus::Counter*, kNumAgentCommandResults> agent_commands_{};
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_METRICS_H_
