// InventoryReport: an agent's committed blocks as the InventoryChunks of one
// AgentControl.ReportInventory stream (sent after every successful Register, so that a
// restarted manager can rebuild its index from them), and FreeInventoryRefusals, which
// applies the reply's to_free.
//
// The report is a snapshot taken at construction: every committed block of the pools,
// grouped by (pool, namespace), each group cut into chunks of at most max_blocks_per_chunk
// blocks. Every chunk carries the agent id, the epoch, the pool's tier, the namespace and the
// spec NamespaceSpecs recorded for it; page and parent hashes are 16 bytes each (little-endian
// lo then hi, as Prompt.page_hashes), with each block's commit time and the namespace's
// max page age, so that a rebuilt index keeps the pages' ages. A committed block whose
// namespace has no recorded spec
// cannot be reported; it is left out and counted in skipped_blocks() (CommandExecutor
// records the spec before committing, so this does not happen).
//
// Not thread-safe; the pools and specs it reads are.
#ifndef KVCM_GPU_AGENT_POOL_INVENTORY_REPORT_H_
#define KVCM_GPU_AGENT_POOL_INVENTORY_REPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "common/types.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/namespace_specs.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

// Most blocks per InventoryChunk (agent.proto).
inline constexpr uint32_t kMaxInventoryChunkBlocks = 16384;

class InventoryReport {
 public:
  // Snapshots `pool` (registered as `tier`) and `host_pool` (TIER_HOST; may be null).
  // REQUIRES: max_blocks_per_chunk >= 1.
  InventoryReport(absl::string_view agent_id, uint64_t epoch, const BlockPool& pool, Tier tier,
                  const BlockPool* host_pool, const NamespaceSpecs& specs,
                  uint32_t max_blocks_per_chunk = kMaxInventoryChunkBlocks);

  // Blocks the chunks carry.
  uint64_t blocks() const { return blocks_; }
  // Committed blocks left out: their namespace has no recorded spec.
  uint64_t skipped_blocks() const { return skipped_blocks_; }
  // Namespaces of the skipped blocks, for the log.
  const std::vector<NamespaceId>& skipped_namespaces() const { return skipped_namespaces_; }

  // Chunks of the stream; 0 when no block is committed.
  size_t chunks() const { return chunks_.size(); }
  // Chunk `i`, in stream order. REQUIRES: i < chunks().
  v1::InventoryChunk Chunk(size_t i) const;

 private:
  // The committed blocks of one namespace in one pool.
  struct Group {
    Tier tier = Tier::kGpu;
    NamespaceId ns;
    ModelSpec spec;
    uint32_t max_page_age_s = 0;
    std::vector<CommittedBlock> blocks;  // in block order
  };
  // Blocks [begin, end) of groups_[group].
  struct ChunkRef {
    size_t group = 0;
    size_t begin = 0;
    size_t end = 0;
  };

  void AddPool(const BlockPool& pool, Tier tier, const NamespaceSpecs& specs);

  const std::string agent_id_;
  const uint64_t epoch_;
  const uint32_t max_blocks_per_chunk_;
  std::vector<Group> groups_;
  std::vector<ChunkRef> chunks_;
  uint64_t blocks_ = 0;
  uint64_t skipped_blocks_ = 0;
  std::vector<NamespaceId> skipped_namespaces_;
};

// What FreeInventoryRefusals did.
struct InventoryFreeResult {
  uint64_t freed_blocks = 0;
  // Blocks of to_free that could not be freed (not committed in the epoch, past the pool,
  // or in a pool the agent does not have), and the first error about them.
  uint64_t refused_blocks = 0;
  absl::Status first_error;
};

// Frees every block of reply.to_free (FreeCommitted for `epoch`) in the pool its tier names:
// `tier` for `pool`, TIER_HOST for `host_pool` (may be null). A list the pool refuses as a
// whole is freed block by block, so one bad id costs only itself.
InventoryFreeResult FreeInventoryRefusals(const v1::InventoryReply& reply, uint64_t epoch,
                                          BlockPool& pool, Tier tier, BlockPool* host_pool);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_INVENTORY_REPORT_H_
