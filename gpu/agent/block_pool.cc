#include "gpu/agent/block_pool.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvcm {

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(
    PoolGeometry geometry, std::unique_ptr<DeviceBackend> backend) {
  if (absl::Status s = geometry.Validate(); !s.ok()) return s;
  if (backend == nullptr) return absl::InvalidArgumentError("backend is required");
  if (backend->arena_bytes() < geometry.pool_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend arena of ", backend->arena_bytes(),
                     " bytes is smaller than the pool's ", geometry.pool_bytes(), " bytes (",
                     geometry.num_blocks, " blocks of ", geometry.bytes_per_block(), ")"));
  }
  return std::unique_ptr<BlockPool>(new BlockPool(std::move(geometry), std::move(backend)));
}

BlockPool::BlockPool(PoolGeometry geometry, std::unique_ptr<DeviceBackend> backend)
    : geometry_(std::move(geometry)),
      bytes_per_block_(geometry_.bytes_per_block()),
      backend_(std::move(backend)) {
  const BlockId n = static_cast<BlockId>(geometry_.num_blocks);
  free_.reserve(n);
  // Pushed in reverse so the first allocations return 0, 1, 2, ...
  for (BlockId id = n; id > 0; --id) free_.push_back(id - 1);
  owner_.assign(n, 0);
}

absl::StatusOr<std::vector<BlockId>> BlockPool::Allocate(uint32_t count, uint64_t owner_epoch) {
  if (count == 0) return absl::InvalidArgumentError("count must be >= 1");
  if (owner_epoch == 0) return absl::InvalidArgumentError("owner_epoch must be >= 1");
  absl::MutexLock lock(&mu_);
  if (count > free_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat("asked for ", count, " blocks, ", free_.size(),
                                                     " of ", owner_.size(), " are free"));
  }
  std::vector<BlockId> out(free_.end() - count, free_.end());
  free_.resize(free_.size() - count);
  for (BlockId id : out) owner_[id] = owner_epoch;
  return out;
}

absl::Status BlockPool::Free(std::span<const BlockId> ids, uint64_t owner_epoch) {
  if (ids.empty()) return absl::InvalidArgumentError("block_ids must not be empty");
  if (owner_epoch == 0) return absl::InvalidArgumentError("owner_epoch must be >= 1");
  std::vector<BlockId> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return absl::InvalidArgumentError(absl::StrCat("block_ids lists block ", *dup, " twice"));
  }
  absl::MutexLock lock(&mu_);
  for (BlockId id : ids) {
    if (id >= owner_.size()) {
      return absl::OutOfRangeError(
          absl::StrCat("block_ids: block ", id, " is past the pool of ", owner_.size(), " blocks"));
    }
    if (owner_[id] == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", id, " is not allocated (double free?)"));
    }
    if (owner_[id] != owner_epoch) {
      return absl::AbortedError(absl::StrCat("block ", id, " belongs to owner epoch ", owner_[id],
                                             ", not ", owner_epoch));
    }
  }
  for (BlockId id : ids) {
    owner_[id] = 0;
    free_.push_back(id);
  }
  return absl::OkStatus();
}

absl::Status BlockPool::CheckOwnedLocked(std::span<const BlockId> ids, uint64_t owner_epoch,
                                         absl::string_view field) const {
  if (ids.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " must not be empty"));
  if (owner_epoch == 0) return absl::InvalidArgumentError("owner_epoch must be >= 1");
  std::vector<BlockId> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " lists block ", *dup, " twice"));
  }
  for (BlockId id : ids) {
    if (id >= owner_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": block ", id, " is past the pool of ", owner_.size(), " blocks"));
    }
    if (owner_[id] == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": block ", id, " is not allocated"));
    }
    if (owner_[id] != owner_epoch) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": block ", id, " belongs to owner epoch ", owner_[id], ", not ", owner_epoch));
    }
  }
  return absl::OkStatus();
}

absl::Status BlockPool::CheckOwned(std::span<const BlockId> ids, uint64_t owner_epoch,
                                   absl::string_view field) const {
  absl::MutexLock lock(&mu_);
  return CheckOwnedLocked(ids, owner_epoch, field);
}

absl::Status BlockPool::WriteBlocks(std::span<const BlockId> ids, uint64_t owner_epoch,
                                    std::span<const std::byte> bytes) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckOwnedLocked(ids, owner_epoch, "block_ids"); !s.ok()) return s;
  if (bytes.size() != ids.size() * bytes_per_block_) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: got ", bytes.size(), ", expected ",
                                                   ids.size(), " blocks x ", bytes_per_block_));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (absl::Status s = backend_->CopyIn(BlockOffset(ids[i]),
                                          bytes.subspan(i * bytes_per_block_, bytes_per_block_));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status BlockPool::ReadBlock(BlockId id, uint64_t owner_epoch, uint64_t offset_in_block,
                                  std::span<std::byte> dst) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckOwnedLocked({&id, 1}, owner_epoch, "block_ids"); !s.ok()) return s;
  if (offset_in_block > bytes_per_block_ || dst.size() > bytes_per_block_ - offset_in_block) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset_in_block, ", +", dst.size(),
                                              ") leave the block of ", bytes_per_block_));
  }
  return backend_->CopyOut(BlockOffset(id) + offset_in_block, dst);
}

absl::Status BlockPool::WithOwnedArena(
    std::span<const BlockId> ids, uint64_t owner_epoch, absl::string_view field,
    absl::FunctionRef<absl::Status(const std::byte* arena)> fn) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckOwnedLocked(ids, owner_epoch, field); !s.ok()) return s;
  return fn(backend_->base());
}

absl::Status BlockPool::WithOwnedHostArena(
    std::span<const BlockId> ids, uint64_t owner_epoch, absl::string_view field,
    absl::FunctionRef<absl::Status(const std::byte* arena)> fn) const {
  if (backend_->is_device()) {
    return absl::FailedPreconditionError(
        absl::StrCat("backend ", backend_->name(), " is device memory, not host memory"));
  }
  return WithOwnedArena(ids, owner_epoch, field, fn);
}

absl::Status BlockPool::CopyBlocksTo(std::span<const BlockId> ids, BlockPool& dst,
                                     std::span<const BlockId> dst_ids, uint64_t owner_epoch) const {
  if (&dst == this) return absl::InvalidArgumentError("dst: must be another pool");
  if (ids.size() != dst_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("target_block_ids: ", dst_ids.size(),
                                                   " ids for ", ids.size(), " source blocks"));
  }
  if (dst.bytes_per_block_ != bytes_per_block_) {
    return absl::InvalidArgumentError(
        absl::StrCat("dst: blocks of ", dst.bytes_per_block_, " bytes, not ", bytes_per_block_));
  }
  absl::MutexLock src_lock(&mu_);
  absl::MutexLock dst_lock(&dst.mu_);
  if (absl::Status s = CheckOwnedLocked(ids, owner_epoch, "source_block_ids"); !s.ok()) return s;
  if (absl::Status s = dst.CheckOwnedLocked(dst_ids, owner_epoch, "target_block_ids"); !s.ok()) {
    return s;
  }
  const bool src_device = backend_->is_device();
  const bool dst_device = dst.backend_->is_device();
  std::vector<std::byte> staging(src_device && dst_device ? bytes_per_block_ : 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint64_t from = BlockOffset(ids[i]);
    const uint64_t to = dst.BlockOffset(dst_ids[i]);
    absl::Status s;
    if (!dst_device) {
      s = backend_->CopyOut(from, {dst.backend_->base() + to, bytes_per_block_});
    } else if (!src_device) {
      s = dst.backend_->CopyIn(to, {backend_->base() + from, bytes_per_block_});
    } else {
      s = backend_->CopyOut(from, staging);
      if (s.ok()) s = dst.backend_->CopyIn(to, staging);
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

uint64_t BlockPool::FreeAllOwnedBy(uint64_t owner_epoch) {
  absl::MutexLock lock(&mu_);
  uint64_t freed = 0;
  for (BlockId id = 0; id < owner_.size(); ++id) {
    if (owner_[id] != owner_epoch || owner_epoch == 0) continue;
    owner_[id] = 0;
    free_.push_back(id);
    ++freed;
  }
  return freed;
}

BlockPoolStats BlockPool::Stats() const {
  absl::MutexLock lock(&mu_);
  BlockPoolStats s;
  s.num_blocks = owner_.size();
  s.free_blocks = free_.size();
  s.bytes_per_block = bytes_per_block_;
  s.capacity_bytes = s.num_blocks * bytes_per_block_;
  s.used_bytes = (s.num_blocks - s.free_blocks) * bytes_per_block_;
  return s;
}

}  // namespace kvcm
