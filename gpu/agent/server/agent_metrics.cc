#include "gpu/agent/server/agent_metrics.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/server_limits.h"
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
    case AgentRpc::kFetch:
      return "Fetch";
  }
  return "unknown";
}

// Pool usage at scrape time. Thread-safe: reads the (thread-safe) pools and epoch.
class AgentMetrics::PoolCollector final : public prometheus::Collectable {
 public:
  PoolCollector(std::string agent_id, AgentPools pools, const AgentEpoch* epoch,
                std::shared_ptr<const DataPortCounters> data_port)
      : agent_id_(std::move(agent_id)),
        pools_(pools),
        epoch_(epoch),
        data_port_(std::move(data_port)) {}

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
    gauge("kvcm_agent_pool_blocks", "Blocks of the agent's block pool.",
          static_cast<double>(s.num_blocks));
    gauge("kvcm_agent_pool_committed_blocks",
          "Allocated blocks committed to a page (the rest are in flight).",
          static_cast<double>(s.committed_blocks));
    gauge("kvcm_agent_registered", "1 when the last Register/Heartbeat succeeded.",
          epoch_->registered() ? 1.0 : 0.0);
    // Microseconds since 1970: exact in a double until the year 2255. The manager's view of
    // it is kvcm_agent_epoch{agent}.
    gauge("kvcm_agent_local_epoch", "The epoch (incarnation) this agent registers with.",
          static_cast<double>(epoch_->current()));
    // The BlockAgent port's accept4 guard and gRPC's rate-limited log (common/server_limits.h).
    auto counter = [&](std::string name, std::string help,
                       std::vector<std::pair<std::string, uint64_t>> by_reason) {
      prometheus::MetricFamily f;
      f.name = std::move(name);
      f.help = std::move(help);
      f.type = prometheus::MetricType::Counter;
      for (const auto& [reason, value] : by_reason) {
        prometheus::ClientMetric m;
        m.label = labels;
        if (!reason.empty()) m.label.push_back({"reason", reason});
        m.counter.value = static_cast<double>(value);
        f.metric.push_back(std::move(m));
      }
      out.push_back(std::move(f));
    };
    uint64_t mismatches = s.digest_mismatches;
    if (pools_.host != nullptr) mismatches += pools_.host->Stats().digest_mismatches;
    counter("kvcm_agent_digest_mismatches_total",
            "Reads refused because a committed block's bytes no longer matched the digest "
            "taken at its commit (--verify_block_digests).",
            {{"", mismatches}});
    const AcceptGuardCounters guard = GetAcceptGuardCounters();
    counter("kvcm_agent_grpc_connections_accepted_total",
            "TCP connections the BlockAgent port accepted.", {{"", guard.accepted}});
    counter("kvcm_agent_grpc_connections_refused_total",
            "TCP connections the BlockAgent port closed as it accepted them, by the limit that "
            "refused them.",
            {{"grpc_max_connections", guard.refused_total_cap},
             {"grpc_max_connections_per_peer", guard.refused_peer_cap},
             {"out_of_fds", guard.shed_fd_exhausted}});
    // The data port's handshake budget and slots (tcp_transport.h, handshake_budget.h).
    const DataPortCounters& d = *data_port_;
    counter("kvcm_agent_data_connections_accepted_total", "TCP connections the data port accepted.",
            {{"", d.accepted.load()}});
    counter("kvcm_agent_data_connections_served_total",
            "Data connections that completed their handshake and took a served slot.",
            {{"", d.served.load()}});
    counter("kvcm_agent_data_connections_closed_total",
            "Data connections closed before they took a served slot, by reason: the option "
            "that refused them as accepted or after their handshake, handshake_evicted "
            "(displaced by a newer one), handshake_timeout, handshake_failed.",
            {{"data_max_handshakes", d.refused_max_handshakes.load()},
             {"data_max_handshakes_per_peer", d.refused_max_handshakes_per_peer.load()},
             {"handshake_evicted", d.handshakes_evicted.load()},
             {"handshake_timeout", d.handshake_timeouts.load()},
             {"handshake_failed", d.handshakes_failed.load()},
             {"data_max_connections", d.refused_max_connections.load()},
             {"data_max_connections_per_peer", d.refused_max_connections_per_peer.load()}});
    counter("kvcm_agent_grpc_log_lines_suppressed_total",
            "gRPC log lines dropped over the 20-a-second limit.", {{"", SuppressedGrpcLogLines()}});
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
  const std::shared_ptr<const DataPortCounters> data_port_;
};

AgentMetrics::AgentMetrics(std::string agent_id, AgentPools pools, const AgentEpoch* epoch)
    : registry_(std::make_shared<prometheus::Registry>()),
      data_port_(std::make_shared<DataPortCounters>()),
      pool_collector_(
          std::make_shared<PoolCollector>(std::move(agent_id), pools, epoch, data_port_)),
      rpcs_(std::make_unique<AgentRpcRecorder>(
          *registry_, "kvcm_agent_rpc", "BlockAgent", [](AgentRpc rpc) {
            return rpc == AgentRpc::kWriteBlocks || rpc == AgentRpc::kReadBlocks;
          })) {
  transfer_bytes_ = &prometheus::BuildCounter()
                         .Name("kvcm_transfer_bytes_total")
                         .Help("Bytes of blocks pulled from peer agents into this agent's pools.")
                         .Register(*registry_)
                         .Add({});
  // 1 ms .. ~65 s: one block over loopback takes a few ms, 64 blocks over a slow link seconds.
  transfer_seconds_ =
      &prometheus::BuildHistogram()
           .Name("kvcm_transfer_seconds")
           .Help("Time of successful pulls from peer agents, connect to last byte.")
           .Register(*registry_)
           .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.004, 0.016, 0.064, 0.256,
                                                            1.024, 4.096, 16.384, 65.536});
  transfer_failures_ = &prometheus::BuildCounter()
                            .Name("kvcm_transfer_failures_total")
                            .Help("Failed pulls from peer agents by reason (status code).")
                            .Register(*registry_);
  local_sessions_ = &prometheus::BuildCounter()
                         .Name("kvcm_agent_local_sessions_total")
                         .Help(
                             "Local data path sessions by result: opened (a hello registered a "
                             "region), refused (a connection over local_max_sessions), "
                             "uid_limit (over local_max_sessions_per_uid), not_allowed (a peer "
                             "not admitted), hello_timeout (no region registered within "
                             "local_hello_timeout_ms), revoked (a session's token no longer "
                             "valid).")
                         .Register(*registry_);
  local_copies_ = &prometheus::BuildCounter()
                       .Name("kvcm_agent_local_copies_total")
                       .Help("LocalCopy requests by direction (load, store) and status code.")
                       .Register(*registry_);
  local_bytes_ = &prometheus::BuildCounter()
                      .Name("kvcm_agent_local_bytes_total")
                      .Help("Bytes copied by the local data path, by direction (load, store).")
                      .Register(*registry_);
  room_allocations_ =
      &prometheus::BuildCounter()
           .Name("kvcm_agent_room_allocations_total")
           .Help(
               "Allocations a full pool could not serve at once, served after the manager "
               "evicted to make room (AgentControl.MakeRoom).")
           .Register(*registry_)
           .Add({});
  room_evicted_pages_ = &prometheus::BuildCounter()
                             .Name("kvcm_agent_room_evicted_pages_total")
                             .Help(
                                 "Pages the manager evicted to make room for this agent's "
                                 "allocations (allocation pressure).")
                             .Register(*registry_)
                             .Add({});
  // 0.5 ms .. ~8 s: a MakeRoom round trip plus the FreeBlocks commands, up to allocate_wait_ms.
  room_wait_seconds_ = &prometheus::BuildHistogram()
                            .Name("kvcm_agent_room_wait_seconds")
                            .Help("Wait of allocations served after the manager made room.")
                            .Register(*registry_)
                            .Add({}, prometheus::Histogram::BucketBoundaries{
                                         0.0005, 0.002, 0.008, 0.032, 0.128, 0.512, 2.048, 8.192});
  prometheus::Family<prometheus::Counter>& failures =
      prometheus::BuildCounter()
          .Name("kvcm_agent_allocation_failures_total")
          .Help(
              "Allocations that failed for want of blocks, by reason: pinned (nothing "
              "evictable: pins or reservations), quota, share (default_tenant_pool_share_pct), "
              "manager_unavailable, free_timeout, "
              "epoch, private (blocks not for the cache: never evicted for), other.")
          .Register(*registry_);
  for (int i = 0; i < kNumAllocationFailures; ++i) {
    allocation_failures_[i] = &failures.Add(
        {{"reason", std::string(AllocationFailureName(static_cast<AllocationFailure>(i)))}});
  }
}

RoomMakerObserver AgentMetrics::room_maker_observer() {
  return RoomMakerObserver{.on_room_made =
                               [this](absl::Duration waited, uint64_t evicted_pages) {
                                 room_allocations_->Increment();
                                 room_evicted_pages_->Increment(static_cast<double>(evicted_pages));
                                 room_wait_seconds_->Observe(absl::ToDoubleSeconds(waited));
                               },
                           .on_failure =
                               [this](AllocationFailure reason) {
                                 allocation_failures_[static_cast<int>(reason)]->Increment();
                               }};
}

AgentMetrics::~AgentMetrics() = default;

void AgentMetrics::RecordTransfer(const absl::Status& status, uint64_t bytes,
                                  absl::Duration elapsed) {
  if (status.ok()) {
    transfer_bytes_->Increment(static_cast<double>(bytes));
    transfer_seconds_->Observe(absl::ToDoubleSeconds(elapsed));
    const double seconds = absl::ToDoubleSeconds(elapsed);
    if (bytes > 0 && seconds > 0) {
      constexpr double kWeight = 1.0 / 8;
      const double gbps = static_cast<double>(bytes) * 8 / seconds / 1e9;
      absl::MutexLock lock(&pull_mu_);
      pull_gbps_ = pull_gbps_ == 0 ? gbps : pull_gbps_ + kWeight * (gbps - pull_gbps_);
    }
    return;
  }
  transfer_failures_->Add({{"reason", absl::StatusCodeToString(status.code())}}).Increment();
}

void AgentMetrics::RecordLocalSession(absl::string_view result) {
  local_sessions_->Add({{"result", std::string(result)}}).Increment();
}

void AgentMetrics::RecordLocalCopy(absl::string_view direction, const absl::Status& status,
                                   uint64_t bytes) {
  const std::string dir(direction);
  local_copies_->Add({{"direction", dir}, {"code", absl::StatusCodeToString(status.code())}})
      .Increment();
  if (bytes > 0) local_bytes_->Add({{"direction", dir}}).Increment(static_cast<double>(bytes));
}

double AgentMetrics::pull_gbps() const {
  absl::MutexLock lock(&pull_mu_);
  return pull_gbps_;
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
