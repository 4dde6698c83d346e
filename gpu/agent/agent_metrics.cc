#include "gpu/agent/agent_metrics.h"

#include <utility>

#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace kvcm {

absl::string_view RpcName(AgentRpc rpc) {
  switch (rpc) {
    case AgentRpc::kAllocate:
      return "Allocate";
    case AgentRpc::kFree:
      return "Free";
    case AgentRpc::kWriteBlocks:
      return "WriteBlocks";
    case AgentRpc::kReadBlocks:
      return "ReadBlocks";
    case AgentRpc::kRunAttention:
      return "RunAttention";
    case AgentRpc::kStats:
      return "Stats";
  }
  return "unknown";
}

// Pool usage at scrape time. Thread-safe: reads the (thread-safe) pools and epoch.
class AgentMetrics::PoolCollector final : public prometheus::Collectable {
 public:
  PoolCollector(std::string agent_id, AgentPools pools, const AgentEpoch* epoch)
      : agent_id_(std::move(agent_id)), pools_(pools), epoch_(epoch) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const BlockPoolStats s = pools_.main->Stats();
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"agent", agent_id_}, {"backend", pools_.main->backend().name()}};
    std::vector<prometheus::MetricFamily> out;
    auto gauge = [&](std::string name, std::string help, double value) {
      prometheus::MetricFamily f;
      f.name = std::move(name);
      f.help = std::move(help);
      f.type = prometheus::MetricType::Gauge;
      prometheus::ClientMetric m;
      m.label = labels;
      m.gauge.value = value;
      f.metric.push_back(std::move(m));
      out.push_back(std::move(f));
    };
    gauge("kvcm_agent_pool_capacity_bytes", "Bytes of the agent's block pool.",
          static_cast<double>(s.capacity_bytes));
    gauge("kvcm_agent_pool_used_bytes", "Bytes of allocated blocks.",
          static_cast<double>(s.used_bytes));
    gauge("kvcm_agent_pool_free_blocks", "Blocks not allocated.",
          static_cast<double>(s.free_blocks));
    gauge("kvcm_agent_registered", "1 when the last Register/Heartbeat succeeded.",
          epoch_->registered() ? 1.0 : 0.0);
    if (pools_.host != nullptr) {
      const BlockPoolStats h = pools_.host->Stats();
      gauge("kvcm_agent_host_pool_capacity_bytes", "Bytes of the agent's host-DRAM pool.",
            static_cast<double>(h.capacity_bytes));
      gauge("kvcm_agent_host_pool_used_bytes", "Bytes of allocated host-pool blocks.",
            static_cast<double>(h.used_bytes));
    }
    return out;
  }

 private:
  const std::string agent_id_;
  const AgentPools pools_;
  const AgentEpoch* const epoch_;
};

AgentMetrics::AgentMetrics(std::string agent_id, AgentPools pools, const AgentEpoch* epoch)
    : registry_(std::make_shared<prometheus::Registry>()),
      pool_collector_(std::make_shared<PoolCollector>(std::move(agent_id), pools, epoch)) {
  requests_ = &prometheus::BuildCounter()
                   .Name("kvcm_agent_rpc_requests_total")
                   .Help("Finished BlockAgent calls by rpc and status code.")
                   .Register(*registry_);
  prometheus::Family<prometheus::Histogram>& durations =
      prometheus::BuildHistogram()
          .Name("kvcm_agent_rpc_duration_seconds")
          .Help("Server-side time of unary BlockAgent calls, decode to reply.")
          .Register(*registry_);
  for (int i = 0; i < kNumAgentRpcs; ++i) {
    const AgentRpc rpc = static_cast<AgentRpc>(i);
    if (rpc != AgentRpc::kWriteBlocks && rpc != AgentRpc::kReadBlocks) {
      duration_by_rpc_[i] =
          &durations.Add({{"rpc", std::string(RpcName(rpc))}}, RpcLatencyBucketsSeconds());
    }
    RequestCounter(rpc, absl::StatusCode::kOk);  // so that rates start from a zero sample
  }
}

AgentMetrics::~AgentMetrics() = default;

prometheus::Counter& AgentMetrics::RequestCounter(AgentRpc rpc, absl::StatusCode code) {
  int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) c = static_cast<int>(absl::StatusCode::kUnknown);
  std::atomic<prometheus::Counter*>& slot = request_by_code_[static_cast<int>(rpc)][c];
  prometheus::Counter* counter = slot.load(std::memory_order_acquire);
  if (counter == nullptr) {
    counter =
        &requests_->Add({{"rpc", std::string(RpcName(rpc))},
                         {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))}});
    slot.store(counter, std::memory_order_release);
  }
  return *counter;
}

void AgentMetrics::RecordRpc(AgentRpc rpc, absl::StatusCode code, absl::Duration latency) {
  RequestCounter(rpc, code).Increment();
  if (prometheus::Histogram* h = duration_by_rpc_[static_cast<int>(rpc)]; h != nullptr) {
    h->Observe(absl::ToDoubleSeconds(latency));
  }
}

void AgentMetrics::RecordStreamEnd(AgentRpc rpc, absl::StatusCode code) {
  RequestCounter(rpc, code).Increment();
}

std::vector<std::weak_ptr<prometheus::Collectable>> AgentMetrics::collectables() const {
  return {registry_, pool_collector_};
}

std::string AgentMetrics::RenderText() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> pools = pool_collector_->Collect();
  families.insert(families.end(), std::make_move_iterator(pools.begin()),
                  std::make_move_iterator(pools.end()));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace kvcm
