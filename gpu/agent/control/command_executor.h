// CommandExecutor: runs the manager's AgentControl commands on an agent's pools, each
// sequence once.
//
// The manager numbers commands per agent epoch and manager incarnation, and resends those it
// has no ack for when a Commands stream reopens, so a command can arrive twice. The
// executor remembers the last sequence it ran and the acks the manager has not confirmed
// (AgentCommand.acked_through), and answers a repeat with its first ack instead of running
// it again (a second FreeBlocks of the same blocks would fail, a second DemoteBlocks would
// copy twice). A restarted manager numbers from 1 again under a new manager_incarnation, in
// the same agent epoch: a command naming another non-zero incarnation than the last one
// seen makes the executor forget the old sequences and acks (never the epoch or a block).
//
//   CommitBlocks   commits allocated blocks of the main pool (its tier) or the host pool
//                  (TIER_HOST) to pages of a namespace (BlockPool::Commit, field
//                  "block_ids"), recording the namespace's spec; the ack lists the blocks
//                  this command newly committed.
//   ReleaseBlocks  committed blocks back to allocated (BlockPool::Release).
//   FreeBlocks     frees committed blocks (BlockPool::FreeCommitted): the manager evicted
//                  them.
//   DemoteBlocks   allocates host-pool blocks for the agent's epoch and copies the listed
//                  main-pool blocks into them, all or nothing (a committed source commits
//                  its copy to the same page); the ack lists the new blocks.
//
// Not thread-safe: the agent's command thread owns it.
#ifndef KVCM_GPU_AGENT_CONTROL_COMMAND_EXECUTOR_H_
#define KVCM_GPU_AGENT_CONTROL_COMMAND_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/types.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/namespace_specs.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

class CommandExecutor {
 public:
  // `pool` is the agent's main pool, registered as `tier`; `host_pool` its host pool or
  // null. `specs` receives the spec of every namespace a CommitBlocks names (the inventory
  // reads it); null: the executor keeps its own. Not owned; they must outlive the executor.
  CommandExecutor(BlockPool* pool, Tier tier, BlockPool* host_pool,
                  NamespaceSpecs* specs = nullptr);

  // Starts agent epoch `epoch`: commands of the previous one are forgotten.
  void Reset(uint64_t epoch);
  uint64_t epoch() const { return epoch_; }

  // The ack for `command`: runs it if its sequence is new, else repeats the earlier ack (or
  // answers ABORTED for a sequence older than the manager confirmed, which it never
  // resends).
  v1::AgentCommandAck Execute(const v1::AgentCommand& command);

 private:
  // The pool `tier` names: the main pool's tier or TIER_HOST (when there is a host pool).
  // INVALID_ARGUMENT naming `field` for any other.
  absl::StatusOr<BlockPool*> PoolOf(v1::Tier tier, absl::string_view field) const;
  absl::StatusOr<std::vector<BlockId>> Commit(const v1::CommitBlocks& commit);
  absl::Status Release(const v1::ReleaseBlocks& release);
  absl::Status Free(const v1::FreeBlocks& free);
  absl::StatusOr<std::vector<BlockId>> Demote(const v1::DemoteBlocks& demote);

  BlockPool* const pool_;
  const Tier tier_;
  BlockPool* const host_pool_;
  NamespaceSpecs own_specs_;  // used when the constructor got none
  NamespaceSpecs* const specs_;
  uint64_t epoch_ = 0;
  // The last non-zero manager_incarnation seen; 0 before any.
  uint64_t manager_incarnation_ = 0;
  uint64_t last_sequence_ = 0;
  // Acks of sequences after the manager's acked_through, in sequence order.
  std::deque<v1::AgentCommandAck> recent_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_CONTROL_COMMAND_EXECUTOR_H_
