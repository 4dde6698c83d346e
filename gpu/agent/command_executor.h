// CommandExecutor: runs the manager's AgentControl commands on an agent's pools, each
// sequence once.
//
// The manager numbers commands per agent epoch and resends those it has no ack for when a
// Commands stream reopens, so a command can arrive twice. The executor remembers the last
// sequence it ran and the acks the manager has not confirmed (AgentCommand.acked_through),
// and answers a repeat with its first ack instead of running it again (a second FreeBlocks
// of the same blocks would fail, a second DemoteBlocks would copy twice).
//
//   FreeBlocks    frees blocks of the main pool (its tier) or the host pool (TIER_HOST),
//                 owned by the agent's epoch.
//   DemoteBlocks  allocates host-pool blocks for the agent's epoch and copies the listed
//                 main-pool blocks into them, all or nothing; the ack lists the new blocks.
//
// Not thread-safe: the agent's command thread owns it.
#ifndef KVCM_GPU_AGENT_COMMAND_EXECUTOR_H_
#define KVCM_GPU_AGENT_COMMAND_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/statusor.h"
#include "common/types.h"
#include "gpu/agent/block_pool.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

class CommandExecutor {
 public:
  // `pool` is the agent's main pool, registered as `tier`; `host_pool` its host pool or
  // null. Not owned; they must outlive the executor.
  CommandExecutor(BlockPool* pool, Tier tier, BlockPool* host_pool);

  // Starts agent epoch `epoch`: commands of the previous one are forgotten.
  void Reset(uint64_t epoch);
  uint64_t epoch() const { return epoch_; }

  // The ack for `command`: runs it if its sequence is new, else repeats the earlier ack (or
  // answers ABORTED for a sequence older than the manager confirmed, which it never
  // resends).
  v1::AgentCommandAck Execute(const v1::AgentCommand& command);

 private:
  absl::Status Free(const v1::FreeBlocks& free);
  absl::StatusOr<std::vector<BlockId>> Demote(const v1::DemoteBlocks& demote);

  BlockPool* const pool_;
  const Tier tier_;
  BlockPool* const host_pool_;
  uint64_t epoch_ = 0;
  uint64_t last_sequence_ = 0;
  // Acks of sequences after the manager's acked_through, in sequence order.
  std::deque<v1::AgentCommandAck> recent_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_COMMAND_EXECUTOR_H_
