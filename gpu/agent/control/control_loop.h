// ControlLoop: the agent's thread that registers with the manager, reports its inventory and
// then heartbeats.
//
// It retries Register (before the first success) or Heartbeat (after) every
// heartbeat_interval_ms while the manager is unreachable, keeping the epoch: an outage alone
// costs nothing. Every successful Register is followed by the inventory (ReportInventory:
// the pools' committed blocks, snapshotted after the Register, see InventoryReport); the
// blocks the reply lists are freed. A registration counts (AgentEpoch::registered(), which
// lets the CommandLoop open its stream) only once its inventory was taken; when the
// inventory fails the next round registers again with the same epoch and sends it again.
//
// What the manager's answers do:
//   NOT_FOUND  it restarted or declared this agent gone: keep the epoch and every block,
//              register again with the same epoch and report the inventory, from which the
//              manager rebuilds its index.
//   ABORTED    another process holds a larger epoch, or ours is stale: the manager no longer
//              refers to this epoch's blocks. Free them all, move the AgentEpoch to a larger
//              epoch, call `on_new_epoch` and register again.
// An inventory the manager refuses as INVALID_ARGUMENT (it cannot take it, and would refuse
// it again) is handled as ABORTED, so that the agent starts over instead of retrying forever.
//
// Thread-compatible: Start and Stop must not run concurrently (Agent serializes them); Stop is
// idempotent and cancels the call in flight. The loop's thread touches only thread-safe state
// (pools, specs, epoch, stub).
#ifndef KVCM_GPU_AGENT_CONTROL_CONTROL_LOOP_H_
#define KVCM_GPU_AGENT_CONTROL_CONTROL_LOOP_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/pool/namespace_specs.h"
#include "gpu/agent/server/agent_metrics.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

class ControlLoop {
 public:
  // `block_agent_address` is what Register tells the manager to call. `specs` are the specs
  // of the committed namespaces, for the inventory. `on_new_epoch` runs on the loop's thread
  // after each epoch renewal; `on_round` (when set) at the start of every round, once per
  // heartbeat_interval_ms (the agent re-reads its tokens file there). Heartbeats report
  // `metrics`' pull bandwidth. The pointers are not owned and must outlive the loop.
  ControlLoop(const AgentOptions* options, AgentPools pools, AgentEpoch* epoch,
              v1::AgentControl::Stub* control, std::string block_agent_address,
              std::string data_address, const NamespaceSpecs* specs, const AgentMetrics* metrics,
              std::function<void()> on_new_epoch, std::function<void()> on_round = nullptr);
  // Stops the thread.
  ~ControlLoop();
  ControlLoop(const ControlLoop&) = delete;
  ControlLoop& operator=(const ControlLoop&) = delete;

  // Starts the thread. REQUIRES: called once.
  void Start();
  // Cancels the call in flight and ends the thread.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Tells the manager this agent stops on purpose (a heartbeat with `leaving`), so that it
  // forgets the agent and its pools at once instead of reporting it gone. Best effort,
  // within a second: a manager that does not hear it declares the agent gone after its
  // heartbeat timeout, as after a crash. REQUIRES: Stop() ran.
  void Leave();

 private:
  void Run();
  // Register, then the inventory: OK only when both succeeded.
  absl::Status Join();
  absl::Status Register();
  absl::Status ReportInventory();
  absl::Status Heartbeat();
  // Frees every block of the current epoch in both pools and moves to a larger epoch.
  void RenewEpoch();
  // Committed blocks in both pools.
  uint64_t CommittedBlocks() const;
  // Records `ctx` as the call in flight, so that Stop can cancel it; false (and nothing
  // recorded) once Stop ran. EndCall forgets it.
  bool BeginCall(grpc::ClientContext* ctx) ABSL_LOCKS_EXCLUDED(mu_);
  void EndCall() ABSL_LOCKS_EXCLUDED(mu_);

  const AgentOptions& options_;
  const AgentPools pools_;
  AgentEpoch* const epoch_;
  v1::AgentControl::Stub* const control_;
  const std::string block_agent_address_;
  const std::string data_address_;
  const AgentMetrics* const metrics_;
  const NamespaceSpecs* const specs_;
  const std::function<void()> on_new_epoch_;
  const std::function<void()> on_round_;
  absl::Notification stop_;
  std::thread thread_;
  absl::Mutex mu_;
  grpc::ClientContext* call_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_CONTROL_CONTROL_LOOP_H_
