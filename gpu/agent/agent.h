// Agent: a running kvcm-agent. Owns the block pool (over the backend CreateBackend chose)
// and, when host_capacity_bytes > 0, a host-DRAM pool of the same geometry that the
// manager demotes pages into; the BlockAgent gRPC server; the control thread that
// registers with the manager and then heartbeats; the command thread; and the optional
// Prometheus exposer.
//
// Epochs: the agent starts with a fresh epoch (microseconds since the Unix epoch, so a
// restarted agent always registers a larger one). Blocks the manager indexes belong to
// that epoch (workers allocate them with it). The control thread retries Register (before
// the first success) or Heartbeat (after) every heartbeat_interval_ms while the manager is
// unreachable, keeping the epoch: an outage alone costs nothing. When the manager answers
// NOT_FOUND or ABORTED (it restarted, or declared this agent gone and dropped its pages),
// the index no longer refers to the epoch's blocks: the agent frees them all, starts a new
// epoch and registers again.
//
// Once registered, the command thread holds an AgentControl.Commands stream open (reopening
// it every heartbeat_interval_ms while it cannot) and runs the manager's FreeBlocks and
// DemoteBlocks through a CommandExecutor, each sequence once.
//
// Used by gpu/agent/main.cc and by tests. Thread-safe: Shutdown and Wait may be called from
// any thread, concurrently and more than once; the accessors are safe at any time.
#ifndef KVCM_GPU_AGENT_AGENT_H_
#define KVCM_GPU_AGENT_AGENT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/block_pool.h"
#include "gpu/agent/command_executor.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace kvcm {

class Agent {
 public:
  // Validates `options`, creates the backend and pool, serves BlockAgent and starts the
  // control thread. INVALID_ARGUMENT for bad options, UNAVAILABLE when an address cannot
  // be bound, RESOURCE_EXHAUSTED when the pool's memory cannot be allocated. The manager
  // need not be up yet.
  static absl::StatusOr<std::unique_ptr<Agent>> Start(AgentOptions options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // "host:port" of the BlockAgent server with the bound port filled in.
  const std::string& address() const { return address_; }
  // "host:port" of /metrics; empty when disabled.
  const std::string& metrics_address() const { return metrics_address_; }
  // The current epoch; changes when the manager forgot the agent (see the class comment).
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }
  // Why this backend was chosen, e.g. "no CUDA device (...): using host DRAM".
  const std::string& backend_reason() const { return backend_reason_; }
  BlockPool& pool() { return *pool_; }
  // The host pool; null when host_capacity_bytes is 0.
  BlockPool* host_pool() { return host_pool_.get(); }
  const AgentOptions& options() const { return options_; }
  // Whether the last Register or Heartbeat succeeded.
  bool registered() const { return registered_.load(std::memory_order_acquire); }

  // Stops the control thread, the BlockAgent server and the exposer. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(shutdown_mu_);
  // Blocks until Shutdown has completed.
  void Wait();

 private:
  class BlockAgentService;
  class PoolCollector;

  explicit Agent(AgentOptions options);
  void ControlLoop();
  absl::Status Register();
  absl::Status Heartbeat();
  // Frees every block of the current epoch in both pools and moves to a larger epoch.
  void RenewEpoch();
  // Frees every block allocated to `epoch` in both pools; returns how many.
  uint64_t FreeBlocksOfEpoch(uint64_t epoch);
  void CommandLoop();
  // Runs one stream: hello, then commands until it ends. The stream's final status.
  absl::Status RunCommandStream();

  const AgentOptions options_;
  std::atomic<uint64_t> epoch_{0};
  std::string backend_reason_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<BlockPool> host_pool_;
  // Command thread only.
  std::unique_ptr<CommandExecutor> executor_;
  std::unique_ptr<BlockAgentService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<PoolCollector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string address_;
  std::string metrics_address_;
  std::unique_ptr<v1::AgentControl::Stub> control_;
  std::atomic<bool> registered_{false};

  absl::Notification stop_control_;
  std::thread control_thread_;
  std::thread command_thread_;
  absl::Mutex command_mu_;
  // The open Commands call, so that Shutdown can cancel it; null between calls.
  grpc::ClientContext* command_ctx_ ABSL_GUARDED_BY(command_mu_) = nullptr;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  absl::Notification shutdown_done_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_AGENT_H_
