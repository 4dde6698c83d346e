// BlockPool: fixed-size blocks carved out of one DeviceBackend arena.
//
// Allocation pops ids from a free list; every allocated block records the owner epoch it
// was allocated for, and Free must name the same epoch, so a restarted worker (a new
// epoch) cannot free blocks of its predecessor by accident. Allocate and Free are all or
// nothing. Byte accounting is exact: used_bytes = allocated blocks x bytes_per_block. The
// pool never allocates device memory after Create: the backend's arena is fixed.
//
// Thread-safe: every method locks mu_; the arena itself is not touched by the pool.
#ifndef KVCM_GPU_AGENT_BLOCK_POOL_H_
#define KVCM_GPU_AGENT_BLOCK_POOL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/agent/device_backend.h"
#include "gpu/agent/pool_geometry.h"
#include "server/core/types.h"

namespace kvcm {

struct BlockPoolStats {
  uint64_t num_blocks = 0;
  uint64_t free_blocks = 0;
  uint64_t bytes_per_block = 0;
  uint64_t capacity_bytes = 0;  // num_blocks x bytes_per_block
  uint64_t used_bytes = 0;      // (num_blocks - free_blocks) x bytes_per_block
};

class BlockPool {
 public:
  // INVALID_ARGUMENT for a bad geometry (see PoolGeometry::Validate) or a backend whose
  // arena is smaller than geometry.pool_bytes() (field "backend").
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(PoolGeometry geometry,
                                                           std::unique_ptr<DeviceBackend> backend);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // `count` distinct free blocks, now owned by `owner_epoch`. INVALID_ARGUMENT for count 0 or
  // owner_epoch 0; RESOURCE_EXHAUSTED (nothing allocated) when fewer than `count` are free.
  absl::StatusOr<std::vector<BlockId>> Allocate(uint32_t count, uint64_t owner_epoch)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Returns `ids` to the free list. All or nothing, checked in this order for every id:
  // INVALID_ARGUMENT for an empty list, owner_epoch 0 or an id listed twice; OUT_OF_RANGE
  // for an id past the pool; FAILED_PRECONDITION for a block that is not allocated (double
  // free); ABORTED for a block allocated by another owner epoch.
  absl::Status Free(std::span<const BlockId> ids, uint64_t owner_epoch) ABSL_LOCKS_EXCLUDED(mu_);

  // Byte offset of block `id` in the backend's arena. REQUIRES: id < num_blocks.
  uint64_t BlockOffset(BlockId id) const { return uint64_t{id} * bytes_per_block_; }

  BlockPoolStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const PoolGeometry& geometry() const { return geometry_; }
  DeviceBackend& backend() const { return *backend_; }

 private:
  BlockPool(PoolGeometry geometry, std::unique_ptr<DeviceBackend> backend);

  const PoolGeometry geometry_;
  const uint64_t bytes_per_block_;
  const std::unique_ptr<DeviceBackend> backend_;
  mutable absl::Mutex mu_;
  // Free block ids; allocation pops from the back.
  std::vector<BlockId> free_ ABSL_GUARDED_BY(mu_);
  // Owner epoch of each block; 0 while the block is free.
  std::vector<uint64_t> owner_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_BLOCK_POOL_H_
