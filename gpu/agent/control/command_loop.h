// CommandLoop: the agent's thread that, once registered, holds an AgentControl.Commands stream
// open (reopening it every heartbeat_interval_ms while it cannot) and runs the manager's
// commands (CommitBlocks, ReleaseBlocks, FreeBlocks, DemoteBlocks) through a CommandExecutor,
// each sequence once. A stream belongs to one epoch: when the epoch changes, the next stream
// first frees what the old epoch still holds and resets the executor. A manager that
// restarted while the epoch stayed (ControlLoop re-registers it) changes nothing here: its
// new manager_incarnation tells the executor to number from 1 again. NCCL link offers
// (AgentCommand.nccl_connect, sequence 0) bypass the executor and are not acknowledged: they
// go to `on_link_offer`, which must not block.
//
// Thread-compatible: Start and Stop must not run concurrently (Agent serializes them); Stop is
// idempotent. CancelStream is thread-safe.
#ifndef KVCM_GPU_AGENT_CONTROL_COMMAND_LOOP_H_
#define KVCM_GPU_AGENT_CONTROL_COMMAND_LOOP_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/control/command_executor.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/pool/namespace_specs.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

class CommandLoop {
 public:
  // `specs` receives the spec of every namespace committed (the ControlLoop's inventories
  // read it). The pointers are not owned and must outlive the loop. `on_link_offer` (may be
  // empty: offers are dropped) runs on the loop's thread.
  CommandLoop(const AgentOptions* options, AgentPools pools, const AgentEpoch* epoch,
              v1::AgentControl::Stub* control, NamespaceSpecs* specs,
              std::function<void(const v1::NcclConnect&)> on_link_offer = {});
  // Stops the thread.
  ~CommandLoop();
  CommandLoop(const CommandLoop&) = delete;
  CommandLoop& operator=(const CommandLoop&) = delete;

  // Starts the thread. REQUIRES: called once.
  void Start();
  // Cancels the open stream and ends the thread.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels the open stream, if any (it belongs to an old epoch); the loop reopens it.
  void CancelStream() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();
  // Runs one stream: hello, then commands until it ends. The stream's final status.
  absl::Status RunStream() ABSL_LOCKS_EXCLUDED(mu_);

  const AgentOptions& options_;
  const AgentPools pools_;
  const AgentEpoch* const epoch_;
  v1::AgentControl::Stub* const control_;
  const std::function<void(const v1::NcclConnect&)> on_link_offer_;
  // The loop's thread only.
  CommandExecutor executor_;
  absl::Notification stop_;
  std::thread thread_;
  absl::Mutex mu_;
  // The open Commands call, so that it can be cancelled; null between calls.
  grpc::ClientContext* stream_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_CONTROL_COMMAND_LOOP_H_
