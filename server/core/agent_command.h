// The manager's commands to an agent and the agent's acks, as core types (the wire form is
// AgentControl.Commands in proto/kvcm/v1/agent.proto; server/service converts).
#ifndef KVCM_SERVER_CORE_AGENT_COMMAND_H_
#define KVCM_SERVER_CORE_AGENT_COMMAND_H_

#include <cstdint>
#include <functional>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/types.h"

namespace kvcm {

// Frees blocks of one of the agent's pools (the index evicted them).
struct FreeBlocksCommand {
  Tier tier = Tier::kGpu;
  std::vector<BlockId> block_ids;  // distinct
};

// Copies blocks of the agent's GPU pool into new blocks of its HOST pool, all or nothing;
// the ack names the new blocks, one per source block, in order.
struct DemoteBlocksCommand {
  std::vector<BlockId> source_block_ids;  // in page order, distinct
};

// Commits blocks of one of the agent's pools to the consecutive pages of one prompt in
// `ns` (block_ids[i] holds pages[i]; the parent of pages[0] is first_parent, zero for a
// prompt's first page), all or nothing; the ack names the blocks newly committed.
struct CommitBlocksCommand {
  Tier tier = Tier::kGpu;
  NamespaceId ns;
  ModelSpec spec;  // the namespace's, kept by the agent for its inventory
  std::vector<BlockId> block_ids;
  std::vector<PageHash> pages;
  PageHash first_parent;
  // The manager's clock when it asked for the commit: the agent records it as the blocks'
  // commit time, so that a rebuilt index knows the pages' ages in the same time base.
  int64_t committed_unix_ms = 0;
  // The namespace's own retention limit (0: the manager's default), kept by the agent for
  // its inventory, so that a restarted manager has it before the worker registers again.
  uint32_t max_page_age_s = 0;
  // The inserting principal (AllocatorName); the agent commits only blocks it allocated.
  std::string committer;
};

// Committed blocks back to allocated: the index did not take their pages.
struct ReleaseBlocksCommand {
  Tier tier = Tier::kGpu;
  std::vector<BlockId> block_ids;  // distinct
};

using AgentCommandBody =
    std::variant<FreeBlocksCommand, DemoteBlocksCommand, CommitBlocksCommand, ReleaseBlocksCommand>;

struct AgentCommand {
  // Per agent epoch, from 1, increasing by one per command.
  uint64_t sequence = 0;
  AgentCommandBody body;
  // Every command up to this sequence has been acknowledged (set when the command is sent).
  uint64_t acked_through = 0;
};

// The agent's answer to the command `sequence`.
struct AgentCommandAck {
  uint64_t sequence = 0;
  // What executing the command returned on the agent.
  absl::Status status;
  // With an OK status: DemoteBlocks' new HOST blocks; CommitBlocks' newly committed blocks.
  std::vector<BlockId> block_ids;
};

// How a queued command ended, given once to the function its sender queued with it: the
// agent's ack (whose own status may be an error), or, for a command that died
// unacknowledged, ABORTED (its agent epoch ended: a newer epoch registered or the agent was
// forgotten) or UNAVAILABLE (the book closed).
using CommandCompletion = std::function<void(const absl::StatusOr<AgentCommandAck>& result)>;

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_AGENT_COMMAND_H_
