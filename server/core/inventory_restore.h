// Rebuilding the index from an agent's inventory (ARCHITECTURE §2: agents are the source of
// truth; a restarted manager rebuilds its index, pools and namespaces from them).
//
// An inventory lists the committed blocks of one agent pool: for each, the namespace (with
// its model spec, which travels with it, so no manager state needs to be durable), the page
// hash it holds and its parent page's hash. RestoreInventory turns the parent links back
// into prompt paths and inserts them, so the pool is prefix-closed again. It indexes what it
// can and returns the blocks the agent should free: pages whose chain does not reach a
// prompt's first page within the pool (an orphan), a second block holding a page already
// indexed in the pool (a duplicate), pages of a namespace whose spec conflicts with the
// registered one (CacheIndex::RegisterModel: a kv_layout too, so the rebuilt namespace
// keeps the layout its pages were written in) or whose page size in bytes is not the pool's
// block size, pages the pool has no room for, and pages already past their namespace's max
// page age (with the pages below them in the pool). Rebuilt pages keep the commit times the
// agent recorded, so their age goes on where it was.
//
// Thread-safe as CacheIndex is: it only calls CacheIndex's public methods.
#ifndef KVCM_SERVER_CORE_INVENTORY_RESTORE_H_
#define KVCM_SERVER_CORE_INVENTORY_RESTORE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "server/core/cache_index.h"

namespace kvcm {

// One committed block of an inventory.
struct InventoryPage {
  BlockId block = 0;
  PageHash page;
  PageHash parent;  // zero for a prompt's first page
  // When the agent committed the block, Unix ms; 0 when it did not say (its age then
  // counts from the rebuild). A time after now counts as now.
  int64_t committed_unix_ms = 0;
};

// The committed blocks of one namespace in one pool.
struct InventoryBatch {
  NamespaceId ns;
  ModelSpec spec;
  // The namespace's own retention limit as the agent last heard it (0: none known); it
  // registers the namespace with it, so the limit holds before the worker registers again.
  absl::Duration max_page_age = absl::ZeroDuration();
  std::vector<InventoryPage> pages;
};

struct RestoreResult {
  uint64_t indexed_pages = 0;    // page-locations now in the index (new or already there)
  uint64_t orphan_pages = 0;     // chain incomplete in the pool
  uint64_t duplicate_pages = 0;  // a second block of a page
  uint64_t refused_pages = 0;    // namespace refused, or no room in the pool
  uint64_t expired_pages = 0;    // past the max page age, or below such a page
  // Blocks the agent should free (none of them is in the index), in no particular order.
  std::vector<BlockId> to_free;
};

// Indexes `batch` into pool `pool` of `index`, whose blocks are `bytes_per_block` bytes.
// Registers the namespace when the index does not know it. INVALID_ARGUMENT naming the
// field, with nothing changed, for a batch the agent cannot have produced: a bad namespace
// name or spec, a block listed twice or kPendingBlock, a negative commit time, a max page
// age past kMaxPageAgeS. NOT_FOUND for an unknown pool.
// With `pool_generation` (CacheIndex::PoolGeneration when the inventory began), ABORTED as
// soon as the pool turns out dropped since: the agent's epoch ended, and its blocks with it.
absl::StatusOr<RestoreResult> RestoreInventory(
    CacheIndex& index, const PoolKey& pool, uint64_t bytes_per_block, const InventoryBatch& batch,
    std::optional<uint64_t> pool_generation = std::nullopt);

// What a whole inventory restored, over every pool of one agent.
struct InventoryOutcome {
  uint64_t indexed_pages = 0;
  uint64_t orphan_pages = 0;
  uint64_t duplicate_pages = 0;
  uint64_t refused_pages = 0;
  uint64_t expired_pages = 0;
  // Blocks the agent should free, by pool tier.
  absl::btree_map<Tier, std::vector<BlockId>> to_free;
};

// Gathers the chunks of one agent's inventory (AgentControl.ReportInventory), checking each
// as it comes, then restores them all at once: a stream that breaks off changes nothing.
// Not thread-safe: one stream owns it.
class InventoryCollector {
 public:
  // One of the agent's pools: its tier, blocks and current generation in the index.
  struct Pool {
    Tier tier = Tier::kGpu;
    uint64_t num_blocks = 0;
    uint64_t generation = 0;
  };
  // `pools`: the agent's pools, whose blocks are all `bytes_per_block` bytes.
  InventoryCollector(std::string agent_id, uint64_t bytes_per_block, std::vector<Pool> pools);

  // Adds committed blocks of namespace `ns` (with its `spec` and own retention limit,
  // 0: none known) in pool `tier`. INVALID_ARGUMENT naming the field, with nothing added:
  // a tier that is not one of the agent's pools ("tier"), a spec other than the one `ns`
  // came with before ("spec"), a block past its pool, kPendingBlock or already listed in
  // this inventory ("block_ids[i]"), a negative commit time ("committed_unix_ms[i]"), a
  // max page age past kMaxPageAgeS ("max_page_age_s"). Chunks of one namespace giving
  // different limits keep the shortest.
  absl::Status Add(Tier tier, const NamespaceId& ns, const ModelSpec& spec,
                   std::vector<InventoryPage> pages,
                   absl::Duration max_page_age = absl::ZeroDuration());

  // Restores every namespace of every pool into `index`. ABORTED when a pool was dropped
  // since the collector was made (what was restored went with it).
  absl::StatusOr<InventoryOutcome> Restore(CacheIndex& index) const;

  uint64_t pages() const { return pages_; }

 private:
  const std::string agent_id_;
  const uint64_t bytes_per_block_;
  const std::vector<Pool> pools_;
  absl::flat_hash_map<NamespaceId, ModelSpec> specs_;
  // Per pool (index into pools_), per namespace.
  std::vector<absl::btree_map<std::string, InventoryBatch>> batches_;
  std::vector<absl::flat_hash_set<BlockId>> seen_;
  uint64_t pages_ = 0;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_INVENTORY_RESTORE_H_
