#include "gpu/agent/pool/block_pool.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/page_hash_core.h"
#include "common/status_macros.h"

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
      backend_(std::move(backend)),
      ledger_(static_cast<uint32_t>(geometry_.num_blocks)) {}

absl::StatusOr<std::vector<BlockId>> BlockPool::Allocate(uint32_t count, uint64_t owner_epoch,
                                                         const NamespaceId* ns,
                                                         std::vector<uint64_t>* generations,
                                                         bool use_held,
                                                         absl::string_view allocator) {
  absl::MutexLock lock(&mu_);
  if (const uint32_t free = ledger_.free_blocks(); !use_held && held_ > 0 && count > 0 &&
                                                   owner_epoch != 0 &&
                                                   free - std::min(free, held_) < count) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "asked for ", count, " blocks, ", free, " of ", ledger_.num_blocks(), " are free and ",
        std::min(free, held_), " of those are held for an allocation waiting for room"));
  }
  std::vector<BlockId> scrub;
  absl::StatusOr<std::vector<BlockId>> ids = ledger_.Allocate(
      count, owner_epoch, ns, generations, &scrub, absl::ToUnixMillis(absl::Now()), allocator);
  if (!ids.ok() || scrub.empty()) return ids;
  // Blocks that may hold another namespace's bytes are zeroed before anyone can read them
  // (same lock): a new allocation never sees another tenant's KV.
  if (zeros_.empty()) zeros_.resize(bytes_per_block_);
  for (BlockId id : scrub) {
    if (absl::Status s = backend_->CopyIn(BlockOffset(id), zeros_); !s.ok()) {
      (void)ledger_.Free(*ids, owner_epoch);
      return s;
    }
  }
  return ids;
}

void BlockPool::EnableDigests(uint64_t k0, uint64_t k1) {
  absl::MutexLock lock(&mu_);
  digests_ = true;
  digest_key_[0] = k0;
  digest_key_[1] = k1;
}

absl::StatusOr<uint64_t> BlockPool::DigestOf(BlockId id) const {
  const std::byte* bytes = backend_->base() + BlockOffset(id);
  if (backend_->is_device()) {
    digest_staging_.resize(bytes_per_block_);
    KVCM_RETURN_IF_ERROR(backend_->CopyOut(BlockOffset(id), digest_staging_));
    bytes = digest_staging_.data();
  }
  const uint64_t d =
      page_hash_core::SipHash128(digest_key_[0], digest_key_[1],
                                 {reinterpret_cast<const char*>(bytes), bytes_per_block_})
          .lo;
  return d == 0 ? 1 : d;  // 0 means "no digest"
}

absl::Status BlockPool::VerifyDigests(std::span<const BlockId> ids, absl::string_view field) const {
  if (!digests_) return absl::OkStatus();
  for (const BlockId id : ids) {
    if (id >= ledger_.num_blocks() || ledger_.digest(id) == 0) continue;
    KVCM_ASSIGN_OR_RETURN(const uint64_t now, DigestOf(id));
    if (now != ledger_.digest(id)) {
      ++digest_mismatches_;
      return absl::DataLossError(absl::StrCat(
          field, ": block ", id,
          "'s bytes changed since its commit (its digest no longer matches): not served"));
    }
  }
  return absl::OkStatus();
}

void BlockPool::SetHeld(uint32_t blocks) {
  absl::MutexLock lock(&mu_);
  held_ = blocks;
}

bool BlockPool::AwaitFree(uint32_t count, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto enough = [this, count]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ledger_.free_blocks() >= count; };
  return mu_.AwaitWithDeadline(absl::Condition(&enough), deadline);
}

uint64_t BlockPool::AllocatedToTenant(uint64_t owner_epoch, absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  return ledger_.AllocatedToTenant(owner_epoch, tenant);
}

uint64_t BlockPool::FreeAllocatedBefore(uint64_t owner_epoch, absl::Time cutoff) {
  absl::MutexLock lock(&mu_);
  return ledger_.FreeAllocatedBefore(owner_epoch, absl::ToUnixMillis(cutoff));
}

absl::Status BlockPool::Free(std::span<const BlockId> ids, uint64_t owner_epoch,
                             std::span<const uint64_t> generations) {
  absl::MutexLock lock(&mu_);
  return ledger_.Free(ids, owner_epoch, generations);
}

absl::StatusOr<std::vector<BlockId>> BlockPool::Commit(const NamespaceId& ns, uint64_t epoch,
                                                       std::span<const CommitEntry> entries,
                                                       absl::string_view field,
                                                       int64_t committed_unix_ms,
                                                       const CommitChecks& checks) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<BlockId>> fresh =
      ledger_.Commit(ns, epoch, entries, field, committed_unix_ms, checks);
  if (!fresh.ok() || !digests_) return fresh;
  for (const BlockId id : *fresh) {
    absl::StatusOr<uint64_t> digest = DigestOf(id);
    // A device error leaves the block without a digest (reads then check nothing).
    if (digest.ok()) ledger_.set_digest(id, *digest);
  }
  return fresh;
}

absl::Status BlockPool::Release(std::span<const BlockId> ids, uint64_t epoch,
                                absl::string_view field) {
  absl::MutexLock lock(&mu_);
  return ledger_.Release(ids, epoch, field);
}

absl::Status BlockPool::FreeCommitted(std::span<const BlockId> ids, uint64_t epoch,
                                      absl::string_view field) {
  absl::MutexLock lock(&mu_);
  return ledger_.FreeCommitted(ids, epoch, field);
}

std::vector<CommittedBlock> BlockPool::Inventory() const {
  absl::MutexLock lock(&mu_);
  std::vector<CommittedBlock> out;
  out.reserve(ledger_.committed_blocks());
  ledger_.ForEachCommitted([&](const CommittedBlock& b) { out.push_back(b); });
  return out;
}

absl::Status BlockPool::CheckOwned(std::span<const BlockId> ids, uint64_t owner_epoch,
                                   absl::string_view field,
                                   std::span<const uint64_t> generations) const {
  absl::MutexLock lock(&mu_);
  return ledger_.Check(ids, owner_epoch, /*writable=*/false, field, generations);
}

absl::Status BlockPool::CheckNamespaces(
    std::span<const BlockId> ids,
    absl::FunctionRef<absl::Status(BlockId id, const NamespaceId* ns)> check,
    std::span<const uint64_t> generations, std::vector<uint64_t>* bound) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = ledger_.CheckGenerations(ids, generations, "block_ids"); !s.ok()) return s;
  for (const BlockId id : ids) {
    const NamespaceId* ns = id < ledger_.num_blocks() ? ledger_.NamespaceOf(id) : nullptr;
    if (absl::Status s = check(id, ns); !s.ok()) return s;
  }
  if (bound != nullptr) {
    bound->clear();
    for (const BlockId id : ids) {
      bound->push_back(id < ledger_.num_blocks() ? ledger_.generation(id) : 0);
    }
  }
  return absl::OkStatus();
}

absl::Status BlockPool::WriteBlocks(std::span<const BlockId> ids, uint64_t owner_epoch,
                                    std::span<const std::byte> bytes,
                                    std::span<const uint64_t> generations) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = ledger_.Check(ids, owner_epoch, /*writable=*/true, "block_ids", generations);
      !s.ok()) {
    return s;
  }
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
    ledger_.AddWritten(ids[i], bytes_per_block_);
  }
  return absl::OkStatus();
}

absl::Status BlockPool::Span(size_t num_ids, uint64_t offset, uint64_t n, absl::string_view field,
                             size_t* first, size_t* last) const {
  const uint64_t total = num_ids * bytes_per_block_;
  if (n == 0 || offset > total || n > total - offset) {
    return absl::OutOfRangeError(absl::StrCat(field, ": bytes [", offset, ", +", n, ") leave the ",
                                              num_ids, " blocks of ", bytes_per_block_, " bytes"));
  }
  *first = offset / bytes_per_block_;
  *last = (offset + n - 1) / bytes_per_block_;
  return absl::OkStatus();
}

absl::Status BlockPool::ForEachPiece(
    std::span<const BlockId> ids, std::span<const uint64_t> generations, uint64_t owner_epoch,
    uint64_t offset, uint64_t n, bool writable, absl::string_view field,
    absl::FunctionRef<absl::Status(uint64_t arena_offset, uint64_t done, uint64_t take)> fn,
    const PageCheck* pages) const {
  size_t first = 0, last = 0;
  KVCM_RETURN_IF_ERROR(Span(ids.size(), offset, n, field, &first, &last));
  const size_t count = last - first + 1;
  const std::span<const uint64_t> gens =
      generations.empty() ? generations : generations.subspan(first, count);
  if (pages != nullptr && (pages->ns == nullptr || pages->pages.size() != ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": one page hash per block required"));
  }
  absl::MutexLock lock(&mu_);
  KVCM_RETURN_IF_ERROR(
      ledger_.Check(ids.subspan(first, count), owner_epoch, writable, field, gens));
  if (pages != nullptr) {
    KVCM_RETURN_IF_ERROR(ledger_.CheckPages(ids.subspan(first, count), *pages->ns,
                                            pages->pages.subspan(first, count), field));
  }
  for (uint64_t done = 0; done < n;) {
    const uint64_t pos = offset + done;
    const uint64_t in_block = pos % bytes_per_block_;
    // A read checks each block's digest once, at the piece that starts the block.
    if (!writable && in_block == 0) {
      KVCM_RETURN_IF_ERROR(VerifyDigests({&ids[pos / bytes_per_block_], 1}, field));
    }
    const uint64_t take = std::min<uint64_t>(bytes_per_block_ - in_block, n - done);
    KVCM_RETURN_IF_ERROR(fn(BlockOffset(ids[pos / bytes_per_block_]) + in_block, done, take));
    done += take;
  }
  return absl::OkStatus();
}

absl::Status BlockPool::WriteRange(std::span<const BlockId> ids,
                                   std::span<const uint64_t> generations, uint64_t owner_epoch,
                                   uint64_t offset, std::span<const std::byte> bytes,
                                   absl::string_view field) {
  return ForEachPiece(
      ids, generations, owner_epoch, offset, bytes.size(), /*writable=*/true, field,
      [&](uint64_t arena_offset, uint64_t done, uint64_t take) {
        mu_.AssertHeld();  // ForEachPiece calls fn under mu_
        KVCM_RETURN_IF_ERROR(backend_->CopyIn(arena_offset, bytes.subspan(done, take)));
        ledger_.AddWritten(static_cast<BlockId>(arena_offset / bytes_per_block_), take);
        return absl::OkStatus();
      });
}

absl::Status BlockPool::ReadRange(std::span<const BlockId> ids,
                                  std::span<const uint64_t> generations, uint64_t owner_epoch,
                                  uint64_t offset, std::span<std::byte> dst,
                                  absl::string_view field, const PageCheck* pages) const {
  return ForEachPiece(
      ids, generations, owner_epoch, offset, dst.size(), /*writable=*/false, field,
      [&](uint64_t arena_offset, uint64_t done, uint64_t take) {
        return backend_->CopyOut(arena_offset, dst.subspan(done, take));
      },
      pages);
}

absl::Status BlockPool::WithCheckedBlocks(
    std::span<const BlockId> ids, uint64_t owner_epoch, bool writable, absl::string_view field,
    std::span<const uint64_t> generations, const PageCheck* pages,
    absl::FunctionRef<absl::Status(DeviceBackend& backend)> fn, std::span<const uint64_t> written) {
  if (pages != nullptr && (writable || pages->ns == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": a page check needs a namespace and applies to reads only"));
  }
  if (!written.empty() && (!writable || written.size() != ids.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": written bytes go with a write, one count per block"));
  }
  absl::MutexLock lock(&mu_);
  KVCM_RETURN_IF_ERROR(ledger_.Check(ids, owner_epoch, writable, field, generations));
  if (pages != nullptr)
    KVCM_RETURN_IF_ERROR(ledger_.CheckPages(ids, *pages->ns, pages->pages, field));
  if (!writable) KVCM_RETURN_IF_ERROR(VerifyDigests(ids, field));
  KVCM_RETURN_IF_ERROR(fn(*backend_));
  for (size_t i = 0; i < written.size(); ++i) ledger_.AddWritten(ids[i], written[i]);
  return absl::OkStatus();
}

absl::Status BlockPool::ReadBlock(BlockId id, uint64_t owner_epoch, uint64_t offset_in_block,
                                  std::span<std::byte> dst) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = ledger_.Check({&id, 1}, owner_epoch, /*writable=*/false, "block_ids");
      !s.ok()) {
    return s;
  }
  if (offset_in_block > bytes_per_block_ || dst.size() > bytes_per_block_ - offset_in_block) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset_in_block, ", +", dst.size(),
                                              ") leave the block of ", bytes_per_block_));
  }
  return backend_->CopyOut(BlockOffset(id) + offset_in_block, dst);
}

absl::Status BlockPool::ReadCommittedBlock(BlockId id, const NamespaceId& ns, const PageHash& page,
                                           std::span<std::byte> dst,
                                           absl::string_view field) const {
  return WithCommittedBlock(id, ns, page, field, [&](const std::byte* /*block*/) {
    return backend_->CopyOut(BlockOffset(id), dst.first(bytes_per_block_));
  });
}

absl::Status BlockPool::WithCommittedBlock(
    BlockId id, const NamespaceId& ns, const PageHash& page, absl::string_view field,
    absl::FunctionRef<absl::Status(const std::byte* block)> fn) const {
  absl::MutexLock lock(&mu_);
  if (id >= ledger_.num_blocks()) {
    return absl::OutOfRangeError(
        absl::StrCat(field, ": block ", id, " is past the pool of ", ledger_.num_blocks()));
  }
  const CommittedBlock c = ledger_.Committed(id);
  if (c.ns == nullptr || *c.ns != ns || c.page != page) {
    return absl::FailedPreconditionError(
        // No page hash or namespace: this message reaches the puller's logs and errors.
        absl::StrCat(field, ": block ", id,
                     " no longer holds page the pull expects (evicted or reused)"));
  }
  KVCM_RETURN_IF_ERROR(VerifyDigests({&id, 1}, field));
  return fn(backend_->base() + BlockOffset(id));
}

absl::Status BlockPool::WithWritableBlock(
    BlockId id, uint64_t owner_epoch, absl::string_view field,
    absl::FunctionRef<absl::StatusOr<uint64_t>(std::byte* block)> fn, uint64_t generation) {
  absl::MutexLock lock(&mu_);
  const std::span<const uint64_t> gens =
      generation == 0 ? std::span<const uint64_t>() : std::span<const uint64_t>(&generation, 1);
  if (absl::Status s = ledger_.Check({&id, 1}, owner_epoch, /*writable=*/true, field, gens);
      !s.ok()) {
    return s;
  }
  KVCM_ASSIGN_OR_RETURN(const uint64_t wrote, fn(backend_->base() + BlockOffset(id)));
  ledger_.AddWritten(id, wrote);
  return absl::OkStatus();
}

absl::Status BlockPool::WithOwnedArena(std::span<const BlockId> ids, uint64_t owner_epoch,
                                       absl::string_view field,
                                       absl::FunctionRef<absl::Status(const std::byte* arena)> fn,
                                       std::span<const uint64_t> generations) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = ledger_.Check(ids, owner_epoch, /*writable=*/false, field, generations);
      !s.ok()) {
    return s;
  }
  return fn(backend_->base());
}

absl::Status BlockPool::WithOwnedHostArena(
    std::span<const BlockId> ids, uint64_t owner_epoch, absl::string_view field,
    absl::FunctionRef<absl::Status(const std::byte* arena)> fn,
    std::span<const uint64_t> generations) const {
  if (backend_->is_device()) {
    return absl::FailedPreconditionError(
        absl::StrCat("backend ", backend_->name(), " is device memory, not host memory"));
  }
  return WithOwnedArena(ids, owner_epoch, field, fn, generations);
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
  if (absl::Status s = ledger_.Check(ids, owner_epoch, /*writable=*/false, "source_block_ids");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          dst.ledger_.Check(dst_ids, owner_epoch, /*writable=*/true, "target_block_ids");
      !s.ok()) {
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
  // The copies hold the sources' pages: commit them alike. Cannot fail: every target was
  // checked allocated to owner_epoch, the sources' owner, above.
  for (size_t i = 0; i < ids.size(); ++i) {
    const CommittedBlock src = ledger_.Committed(ids[i]);
    if (src.ns == nullptr) continue;
    (void)dst.ledger_.CommitCopy(dst_ids[i], src);
    if (dst.digests_) dst.ledger_.set_digest(dst_ids[i], ledger_.digest(ids[i]));
  }
  return absl::OkStatus();
}

uint64_t BlockPool::FreeAllOwnedBy(uint64_t owner_epoch) {
  absl::MutexLock lock(&mu_);
  return ledger_.FreeAllOwnedBy(owner_epoch);
}

BlockPoolStats BlockPool::Stats() const {
  absl::MutexLock lock(&mu_);
  BlockPoolStats s;
  s.num_blocks = ledger_.num_blocks();
  s.free_blocks = ledger_.free_blocks();
  s.committed_blocks = ledger_.committed_blocks();
  s.held_blocks = std::min(ledger_.free_blocks(), held_);
  s.digest_mismatches = digest_mismatches_;
  s.bytes_per_block = bytes_per_block_;
  s.capacity_bytes = s.num_blocks * bytes_per_block_;
  s.used_bytes = (s.num_blocks - s.free_blocks) * bytes_per_block_;
  return s;
}

}  // namespace kvcm
