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
// registered one or whose page size in bytes is not the pool's block size, and pages the
// pool has no room for.
//
// Thread-safe as CacheIndex is: it only calls CacheIndex's public methods.
#ifndef KVCM_SERVER_CORE_INVENTORY_RESTORE_H_
#define KVCM_SERVER_CORE_INVENTORY_RESTORE_H_

#include <cstdint>
#include <span>
#include <vector>

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
};

// The committed blocks of one namespace in one pool.
struct InventoryBatch {
  NamespaceId ns;
  ModelSpec spec;
  std::vector<InventoryPage> pages;
};

struct RestoreResult {
  uint64_t indexed_pages = 0;    // page-locations now in the index (new or already there)
  uint64_t orphan_pages = 0;     // chain incomplete in the pool
  uint64_t duplicate_pages = 0;  // a second block of a page
  uint64_t refused_pages = 0;    // namespace refused, or no room in the pool
  // Blocks the agent should free (none of them is in the index), in no particular order.
  std::vector<BlockId> to_free;
};

// Indexes `batch` into pool `pool` of `index`, whose blocks are `bytes_per_block` bytes.
// Registers the namespace when the index does not know it. INVALID_ARGUMENT naming the
// field, with nothing changed, for a batch the agent cannot have produced: a bad namespace
// name or spec, a block listed twice or kPendingBlock. NOT_FOUND for an unknown pool.
absl::StatusOr<RestoreResult> RestoreInventory(CacheIndex& index, const PoolKey& pool,
                                               uint64_t bytes_per_block,
                                               const InventoryBatch& batch);

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_INVENTORY_RESTORE_H_
