// Blocks a command-line worker allocates on an agent for an Insert (kvcmctl insert), the way
// an inference worker does: allocated to the namespace with the agent's epoch as owner
// (agent.proto, CommitBlocks), handed back when the manager did not keep them.
#ifndef KVCM_CLIENT_AGENT_BLOCKS_H_
#define KVCM_CLIENT_AGENT_BLOCKS_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/types.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

class AgentBlocks {
 public:
  // Connects to the BlockAgent at `address` and allocates `count` blocks for `ns` with the
  // agent's epoch. The agent's errors as they are (RESOURCE_EXHAUSTED when it is full).
  static absl::StatusOr<AgentBlocks> Allocate(const std::string& address, const NamespaceId& ns,
                                              uint32_t count);

  // Frees `ids` (blocks of this allocation the manager did not index); best effort.
  absl::Status Free(std::span<const BlockId> ids);

  uint64_t epoch() const { return epoch_; }
  const std::vector<BlockId>& ids() const { return ids_; }

 private:
  std::shared_ptr<v1::BlockAgent::Stub> stub_;
  uint64_t epoch_ = 0;
  std::vector<BlockId> ids_;
};

}  // namespace kvcm

#endif  // KVCM_CLIENT_AGENT_BLOCKS_H_
