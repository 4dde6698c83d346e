// ControlLoop: the agent's thread that registers with the manager and then heartbeats.
//
// It retries Register (before the first success) or Heartbeat (after) every
// heartbeat_interval_ms while the manager is unreachable, keeping the epoch: an outage alone
// costs nothing. When the manager answers NOT_FOUND or ABORTED (it restarted, or declared this
// agent gone and dropped its pages), the index no longer refers to the epoch's blocks: the
// loop frees them all, moves the AgentEpoch to a larger epoch, calls `on_new_epoch` and
// registers again. AgentEpoch::registered() follows the last attempt.
//
// Thread-compatible: Start and Stop must not run concurrently (Agent serializes them); Stop is
// idempotent. The loop's thread touches only thread-safe state (pools, epoch, stub).
#ifndef KVCM_GPU_AGENT_CONTROL_LOOP_H_
#define KVCM_GPU_AGENT_CONTROL_LOOP_H_

#include <functional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/agent_state.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

class ControlLoop {
 public:
  // `block_agent_address` is what Register tells the manager to call. `on_new_epoch` runs on
  // the loop's thread after each epoch renewal. The pointers are not owned and must outlive
  // the loop.
  ControlLoop(const AgentOptions* options, AgentPools pools, AgentEpoch* epoch,
              v1::AgentControl::Stub* control, std::string block_agent_address,
              std::function<void()> on_new_epoch);
  // Stops the thread.
  ~ControlLoop();
  ControlLoop(const ControlLoop&) = delete;
  ControlLoop& operator=(const ControlLoop&) = delete;

  // Starts the thread. REQUIRES: called once.
  void Start();
  // Ends the thread, after the call in flight (bounded by its deadline) returns.
  void Stop();

 private:
  void Run();
  absl::Status Register();
  absl::Status Heartbeat();
  // Frees every block of the current epoch in both pools and moves to a larger epoch.
  void RenewEpoch();

  const AgentOptions& options_;
  const AgentPools pools_;
  AgentEpoch* const epoch_;
  v1::AgentControl::Stub* const control_;
  const std::string block_agent_address_;
  const std::function<void()> on_new_epoch_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_CONTROL_LOOP_H_
