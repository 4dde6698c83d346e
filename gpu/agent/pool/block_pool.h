// BlockPool: fixed-size blocks carved out of one DeviceBackend arena.
//
// What each block holds is the pool's BlockLedger (free, allocated to an owner epoch and
// namespace, or committed to one page): Free must name the owner epoch, so a restarted
// worker (a new epoch) cannot free blocks of its predecessor by accident, and a committed
// block belongs to the cache (immutable; freed by the manager). Every mutation is all or
// nothing. Byte accounting is exact: used_bytes = allocated blocks x bytes_per_block. The
// pool never allocates device memory after Create: the backend's arena is fixed.
//
// WriteBlocks / WriteRange / ReadRange move raw bytes between the host and allocated blocks
// through the backend's CopyIn / CopyOut (cudaMemcpy on a device), checking ownership first,
// under the same lock as the copy. Every method that takes `generations` (parallel to its
// ids; empty: not checked) also requires each block to be still in that allocation
// (BlockLedger::CheckGenerations: ABORTED otherwise), in the same critical section as what
// it does, so an id kept past its Free never reaches the block's next allocation.
//
// Within a tenant (BlockLedger): every write records its bytes against the block's
// allocation, so a commit can require the block written whole and by its allocator
// (CommitChecks). With digests on (EnableDigests, the agent's --verify_block_digests), a
// commit also takes a keyed digest of each new block's bytes, and every read of a committed
// block checks it first: DATA_LOSS, nothing copied, for a block whose bytes changed since.
//
// Thread-safe: every method locks mu_; the arena is touched only by WriteBlocks, ReadBlock
// and the callbacks of WithOwnedArena / WithOwnedHostArena, all under mu_ and all over
// owned blocks.
#ifndef KVCM_GPU_AGENT_POOL_BLOCK_POOL_H_
#define KVCM_GPU_AGENT_POOL_BLOCK_POOL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/types.h"
#include "gpu/agent/pool/block_ledger.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/agent/pool/pool_geometry.h"

namespace kvcm {

struct BlockPoolStats {
  uint64_t num_blocks = 0;
  uint64_t free_blocks = 0;
  uint64_t bytes_per_block = 0;
  uint64_t capacity_bytes = 0;     // num_blocks x bytes_per_block
  uint64_t used_bytes = 0;         // (num_blocks - free_blocks) x bytes_per_block
  uint64_t committed_blocks = 0;   // of the allocated ones, those committed to a page
  uint64_t held_blocks = 0;        // of the free ones, those held for a waiting allocation
  uint64_t digest_mismatches = 0;  // reads refused: a committed block's bytes had changed
};

// The pages blocks must hold for a page-verified read: block ids[i] committed in `ns` to
// pages[i] (BlockLedger::CheckPages), parallel to the ids it goes with. Not owning.
struct PageCheck {
  const NamespaceId* ns = nullptr;
  std::span<const PageHash> pages;
};

class BlockPool {
 public:
  // INVALID_ARGUMENT for a bad geometry (see PoolGeometry::Validate) or a backend whose
  // arena is smaller than geometry.pool_bytes() (field "backend").
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(PoolGeometry geometry,
                                                           std::unique_ptr<DeviceBackend> backend);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // `count` distinct free blocks, now owned by `owner_epoch` and, when `ns` is given, that
  // namespace (BlockLedger::Allocate). RESOURCE_EXHAUSTED (nothing allocated) when fewer
  // than `count` are free beyond those held for a waiting allocation (SetHeld); with
  // `use_held` (the waiting allocation itself), held blocks count as free.
  // With `generations`, it is set to the allocation's generation of each block. A block
  // whose previous allocation was in another namespace (or that was never allocated) is
  // zeroed first, so no allocation reads another tenant's bytes.
  // `allocator` names the principal that alone may commit the blocks (BlockLedger).
  absl::StatusOr<std::vector<BlockId>> Allocate(uint32_t count, uint64_t owner_epoch,
                                                const NamespaceId* ns = nullptr,
                                                std::vector<uint64_t>* generations = nullptr,
                                                bool use_held = false,
                                                absl::string_view allocator = {})
      ABSL_LOCKS_EXCLUDED(mu_);

  // Digests on, keyed by (k0, k1): see the class comment. Call before the pool is shared;
  // give every pool of one agent the same key, so a demoted copy keeps its digest.
  void EnableDigests(uint64_t k0, uint64_t k1) ABSL_LOCKS_EXCLUDED(mu_);

  // Free blocks that only an Allocate with use_held may take: an allocation waiting for the
  // manager to make room holds them, so that blocks its evictions free are not taken by an
  // allocation that came later (RoomMaker). 0 releases them.
  void SetHeld(uint32_t blocks) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until at least `count` blocks are free (held ones included) or `deadline` passes;
  // returns whether they are.
  bool AwaitFree(uint32_t count, absl::Time deadline) const ABSL_LOCKS_EXCLUDED(mu_);

  // BlockLedger::AllocatedToTenant under the pool's lock.
  uint64_t AllocatedToTenant(uint64_t owner_epoch, absl::string_view tenant) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Frees the blocks allocated to `owner_epoch` for a namespace and not committed since
  // before `cutoff` (BlockLedger::FreeAllocatedBefore); returns how many.
  uint64_t FreeAllocatedBefore(uint64_t owner_epoch, absl::Time cutoff) ABSL_LOCKS_EXCLUDED(mu_);

  // Returns allocated blocks to the free list (BlockLedger::Free): INVALID_ARGUMENT for an
  // empty list, owner_epoch 0 or an id listed twice; OUT_OF_RANGE for an id past the pool;
  // FAILED_PRECONDITION for a free (double free) or committed block; ABORTED for a block
  // of another owner epoch.
  absl::Status Free(std::span<const BlockId> ids, uint64_t owner_epoch,
                    std::span<const uint64_t> generations = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // The ledger's Commit, Release and FreeCommitted, under the pool's lock; a commit also
  // takes the new blocks' digests when digests are on.
  absl::StatusOr<std::vector<BlockId>> Commit(const NamespaceId& ns, uint64_t epoch,
                                              std::span<const CommitEntry> entries,
                                              absl::string_view field,
                                              int64_t committed_unix_ms = 0,
                                              const CommitChecks& checks = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Release(std::span<const BlockId> ids, uint64_t epoch, absl::string_view field)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FreeCommitted(std::span<const BlockId> ids, uint64_t epoch, absl::string_view field)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Every committed block, in block order (the pool's inventory).
  std::vector<CommittedBlock> Inventory() const ABSL_LOCKS_EXCLUDED(mu_);

  // OK when `ids` are distinct, inside the pool and allocated to or committed by
  // `owner_epoch` (readable); nothing is changed. Errors name `field` (e.g. "block_ids"):
  // INVALID_ARGUMENT for an empty list, owner_epoch 0, an id listed twice or one past the
  // pool; FAILED_PRECONDITION for a block that is not allocated or is allocated by another
  // owner epoch. The answer may be stale as soon as it returns (another thread may Free);
  // the copy methods check again.
  absl::Status CheckOwned(std::span<const BlockId> ids, uint64_t owner_epoch,
                          absl::string_view field, std::span<const uint64_t> generations = {}) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `check` on each of `ids` in order, with the namespace it was allocated to (null for a
  // free block, one allocated without a namespace, or an id past the pool), and returns the
  // first error; nothing is changed. Holds mu_ throughout: `check` must not call the pool.
  // The answer may be stale as soon as it returns, as CheckOwned's, but not for the
  // generations: `generations` (empty, or 0 entries: any) are checked first in the same
  // critical section (ABORTED for one that ended), and with `bound`, on success, it is set to
  // each block's generation now (0 for a free block), parallel to `ids`. An allocation's
  // namespace never changes while its generation lasts, so calls made with the bound
  // generations act only on the allocations `check` passed.
  absl::Status CheckNamespaces(
      std::span<const BlockId> ids,
      absl::FunctionRef<absl::Status(BlockId id, const NamespaceId* ns)> check,
      std::span<const uint64_t> generations = {}, std::vector<uint64_t>* bound = nullptr) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Overwrites whole blocks: byte i of `bytes` goes to byte i % bytes_per_block of block
  // ids[i / bytes_per_block]. All or nothing: errors as CheckOwned (field "block_ids"),
  // FAILED_PRECONDITION for a committed block (immutable), and
  // INVALID_ARGUMENT "bytes" unless bytes.size() == ids.size() x bytes_per_block, are
  // returned before any byte is copied. Holds mu_ while copying, so no Free interleaves.
  absl::Status WriteBlocks(std::span<const BlockId> ids, uint64_t owner_epoch,
                           std::span<const std::byte> bytes,
                           std::span<const uint64_t> generations = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // Writes `bytes` at byte `offset` of blocks `ids` laid end to end (byte o goes to byte
  // o % bytes_per_block of ids[o / bytes_per_block]): one chunk of a WriteBlocks stream.
  // Only the blocks the range touches are checked, writable as WriteBlocks and in their
  // generations, all before any byte is copied and under the lock held for the copy.
  // Errors name `field`; OUT_OF_RANGE when the range leaves the blocks. `generations` is
  // parallel to `ids`, or empty (not checked).
  absl::Status WriteRange(std::span<const BlockId> ids, std::span<const uint64_t> generations,
                          uint64_t owner_epoch, uint64_t offset, std::span<const std::byte> bytes,
                          absl::string_view field) ABSL_LOCKS_EXCLUDED(mu_);

  // Copies dst.size() bytes at byte `offset` of blocks `ids` laid end to end into `dst`:
  // one chunk of a ReadBlocks stream. Checks as WriteRange but readable (committed blocks
  // of owner_epoch too); `generations` may be empty (not checked). With `pages` (parallel to
  // `ids`), each block the range touches must also hold its page (BlockLedger::CheckPages:
  // ABORTED otherwise), checked in the same critical section as the copy.
  absl::Status ReadRange(std::span<const BlockId> ids, std::span<const uint64_t> generations,
                         uint64_t owner_epoch, uint64_t offset, std::span<std::byte> dst,
                         absl::string_view field, const PageCheck* pages = nullptr) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Checks `ids` as WriteBlocks (`writable`: allocated to owner_epoch, not committed) or as
  // ReadRange (readable), in `generations` (empty: not checked) and, when `pages` is given
  // (readable only), holding those pages; then runs `fn` on the backend while holding mu_,
  // so no Free, Commit or write interleaves. All checks pass before `fn` runs. For copies
  // between blocks of `ids` and memory outside the pool (the local data path): `fn` must
  // touch only blocks of `ids` (at BlockOffset), finish its copies (device work
  // synchronised) before returning, and not call back into the pool. Errors name `field`.
  // `written` (writable only; empty or parallel to `ids`): the bytes `fn` writes into each
  // block, recorded when it returns OK. A read checks committed blocks' digests first.
  absl::Status WithCheckedBlocks(std::span<const BlockId> ids, uint64_t owner_epoch, bool writable,
                                 absl::string_view field, std::span<const uint64_t> generations,
                                 const PageCheck* pages,
                                 absl::FunctionRef<absl::Status(DeviceBackend& backend)> fn,
                                 std::span<const uint64_t> written = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // Copies dst.size() bytes of block `id`, from byte `offset_in_block`, into `dst`. Errors
  // as CheckOwned for the one id (field "block_ids"); OUT_OF_RANGE when the range leaves
  // the block.
  absl::Status ReadBlock(BlockId id, uint64_t owner_epoch, uint64_t offset_in_block,
                         std::span<std::byte> dst) const ABSL_LOCKS_EXCLUDED(mu_);

  // Copies the whole of block `id` into `dst` if it is committed to page `page` of `ns`
  // (what a peer pulling the page expects it to hold): FAILED_PRECONDITION naming
  // `field` otherwise (freed, or reused for another page, since the peer matched it);
  // OUT_OF_RANGE for an id past the pool. REQUIRES: dst.size() == bytes_per_block.
  absl::Status ReadCommittedBlock(BlockId id, const NamespaceId& ns, const PageHash& page,
                                  std::span<std::byte> dst, absl::string_view field) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `fn` on the start of block `id` in the arena (bytes_per_block long; device memory
  // when backend().is_device()) while holding mu_, if the block is committed to page `page`
  // of `ns`; errors as ReadCommittedBlock otherwise, without running `fn`. For copies of a
  // served block into a transfer's staging buffer: `fn` must finish its copy before
  // returning and must not call back into the pool.
  absl::Status WithCommittedBlock(BlockId id, const NamespaceId& ns, const PageHash& page,
                                  absl::string_view field,
                                  absl::FunctionRef<absl::Status(const std::byte* block)> fn) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `fn` on the start of block `id` in the arena while holding mu_, if the block is
  // allocated to `owner_epoch` and not committed (writable, as WriteBlocks checks; errors
  // name `field`) and, when `generation` is not 0, still in that allocation. For copies from
  // a transfer's staging buffer into a pulled block; `fn` as for WithCommittedBlock, and
  // returns how many bytes it wrote (recorded against the allocation).
  absl::Status WithWritableBlock(BlockId id, uint64_t owner_epoch, absl::string_view field,
                                 absl::FunctionRef<absl::StatusOr<uint64_t>(std::byte* block)> fn,
                                 uint64_t generation = 0) ABSL_LOCKS_EXCLUDED(mu_);

  // Checks `ids` as CheckOwned (errors name `field`), then runs `fn` on the arena
  // (backend().base(), arena_bytes long, block b at BlockOffset(b)) while holding mu_, so no
  // WriteBlocks or Free interleaves; returns what `fn` returns. The arena is device memory
  // when backend().is_device(): `fn` may hand it to device code but must not dereference it.
  // `fn` must not call back into the pool, and must be done with the arena (device work
  // synchronised) when it returns.
  absl::Status WithOwnedArena(std::span<const BlockId> ids, uint64_t owner_epoch,
                              absl::string_view field,
                              absl::FunctionRef<absl::Status(const std::byte* arena)> fn,
                              std::span<const uint64_t> generations = {}) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // WithOwnedArena for a host backend only: FAILED_PRECONDITION (before checking `ids`) when
  // the backend is device memory, so `fn` may dereference the arena.
  absl::Status WithOwnedHostArena(std::span<const BlockId> ids, uint64_t owner_epoch,
                                  absl::string_view field,
                                  absl::FunctionRef<absl::Status(const std::byte* arena)> fn,
                                  std::span<const uint64_t> generations = {}) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Byte offset of block `id` in the backend's arena. REQUIRES: id < num_blocks.
  uint64_t BlockOffset(BlockId id) const { return uint64_t{id} * bytes_per_block_; }

  // Copies whole blocks `ids` of this pool into blocks `dst_ids` of `dst`, all allocated to
  // `owner_epoch`, holding both pools' locks (this pool's first: copies between two pools
  // must all go one way, as demotion does, GPU pool to host pool). One copy per block: a
  // device-to-host (or host-to-device) memcpy straight into the other arena, staged through
  // host memory only between two device pools. Nothing is copied unless every check
  // passes: INVALID_ARGUMENT when `dst` is this pool, the id counts differ or the block
  // sizes differ; errors as CheckOwned naming "source_block_ids" / "target_block_ids"
  // (targets must be allocated, not committed). A target whose source is committed
  // becomes committed to the same page, so a demoted copy is in the inventory too.
  absl::Status CopyBlocksTo(std::span<const BlockId> ids, BlockPool& dst,
                            std::span<const BlockId> dst_ids, uint64_t owner_epoch) const
      ABSL_LOCKS_EXCLUDED(mu_, dst.mu_);

  // Frees every block allocated to or committed by `owner_epoch` (e.g. the cache's blocks of
  // an agent epoch that ended); returns how many.
  uint64_t FreeAllOwnedBy(uint64_t owner_epoch) ABSL_LOCKS_EXCLUDED(mu_);

  BlockPoolStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  const PoolGeometry& geometry() const { return geometry_; }
  DeviceBackend& backend() const { return *backend_; }

 private:
  BlockPool(PoolGeometry geometry, std::unique_ptr<DeviceBackend> backend);

  // The blocks of `ids` that bytes [offset, offset + n) of them laid end to end touch, as
  // [first, last] indexes into ids; OUT_OF_RANGE naming `field` when the range leaves them.
  // Checks the blocks the byte range [offset, offset + n) of the concatenated blocks `ids`
  // touches (Span, then the ledger's Check with their `generations`, writable or readable),
  // then, holding mu_, calls fn(arena offset, bytes done, bytes to take) for each piece of the
  // range, one per block, in order; stops at fn's first error. `fn` must not call the pool.
  absl::Status ForEachPiece(
      std::span<const BlockId> ids, std::span<const uint64_t> generations, uint64_t owner_epoch,
      uint64_t offset, uint64_t n, bool writable, absl::string_view field,
      absl::FunctionRef<absl::Status(uint64_t arena_offset, uint64_t done, uint64_t take)> fn,
      const PageCheck* pages = nullptr) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Span(size_t num_ids, uint64_t offset, uint64_t n, absl::string_view field,
                    size_t* first, size_t* last) const;
  // The keyed digest of block `id`'s bytes now (never 0). REQUIRES: digests on.
  absl::StatusOr<uint64_t> DigestOf(BlockId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK unless a block of `ids` is committed with a digest its bytes no longer match
  // (DATA_LOSS naming `field`, counted). No-op with digests off.
  absl::Status VerifyDigests(std::span<const BlockId> ids, absl::string_view field) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PoolGeometry geometry_;
  const uint64_t bytes_per_block_;
  const std::unique_ptr<DeviceBackend> backend_;
  mutable absl::Mutex mu_;
  BlockLedger ledger_ ABSL_GUARDED_BY(mu_);
  uint32_t held_ ABSL_GUARDED_BY(mu_) = 0;  // SetHeld
  // bytes_per_block zero bytes, made at the first scrub (BlockPool::Allocate).
  std::vector<std::byte> zeros_ ABSL_GUARDED_BY(mu_);
  bool digests_ ABSL_GUARDED_BY(mu_) = false;  // EnableDigests
  uint64_t digest_key_[2] ABSL_GUARDED_BY(mu_) = {0, 0};
  // A device block's bytes, copied out to be digested.
  mutable std::vector<std::byte> digest_staging_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t digest_mismatches_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_BLOCK_POOL_H_
