// BlockLedger: what every block of one agent pool holds — the agent's record that makes it
// the source of truth for its KV (ARCHITECTURE §2).
//
//   free ──Allocate(owner, ns)──▶ allocated ──Commit(ns, page, parent)──▶ committed
//     ▲           │ Free(owner)        ▲                │
//     └───────────┘                    └──Release───────┤ (the index did not take it)
//     ▲                                                 │
//     └──────────FreeCommitted (the manager evicted it)─┘
//
// Only a block allocated to namespace n in the agent's epoch can be committed, and only to
// one page of n: a committed block holds page `page` of namespace `ns`, whose parent page
// is `parent` (zero for a prompt's first page), so inventories can rebuild every chain, and
// when it was committed, so a rebuilt index knows each page's age (retention). A
// committed block is immutable (no writes) and belongs to the cache: only FreeCommitted
// (the manager's FreeBlocks) or the end of its epoch frees it, never its allocator.
//
// Every allocation gets a generation: a pool-wide counter, never reused, that Allocate hands
// out per block and that ends when the block is freed. Calls that name generations
// (parallel to their ids) act only while each block is still in that allocation, so an id
// kept past its Free (a stream opened before the Free) can never reach the block's next
// owner, whatever order free blocks are reused in. The free list is FIFO (a freed block is
// reused last), which only makes stale ids rarer; correctness does not depend on it.
//
// Within a tenant (docs/SECURITY.md, "Within a tenant"): an allocation records the
// principal that asked for it, and the bytes written into it since; a commit that names its
// principal (CommitChecks) is refused for a block another principal allocated, or one not
// yet written whole. A committed block may also keep a digest of its bytes (BlockPool
// checks it at every read when digests are on).
//
// Every mutation is all or nothing, and every error names the field it is about. Not
// thread-safe: BlockPool guards its ledger with its own mutex.
#ifndef KVCM_GPU_AGENT_POOL_BLOCK_LEDGER_H_
#define KVCM_GPU_AGENT_POOL_BLOCK_LEDGER_H_

#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/page_hash.h"
#include "common/types.h"

namespace kvcm {

// One page to commit: block `block` holds page `page`, whose parent page is `parent`.
struct CommitEntry {
  BlockId block = 0;
  PageHash page;
  PageHash parent;
};

// What a commit from outside the agent (the manager's CommitBlocks) must also hold.
struct CommitChecks {
  // The principal whose Insert asked for the commit (its token's name); empty: not checked.
  // A block whose allocation recorded another (non-empty) principal is PERMISSION_DENIED.
  absl::string_view committer;
  // The pool's block size; 0: not checked. A block with fewer bytes written since its
  // allocation is FAILED_PRECONDITION.
  uint64_t block_bytes = 0;
};

// One committed block, as inventories report it.
struct CommittedBlock {
  const NamespaceId* ns = nullptr;  // owned by the ledger
  BlockId block = 0;
  PageHash page;
  PageHash parent;
  uint64_t owner_epoch = 0;
  // When it was committed, Unix ms (0: not recorded).
  int64_t committed_unix_ms = 0;
};

class BlockLedger {
 public:
  enum class State : uint8_t { kFree, kAllocated, kCommitted };

  // Generations start at `first_generation`; 0 (the default) takes the wall clock in
  // nanoseconds, so a restarted agent never hands out a generation its predecessor gave.
  // REQUIRES: 0 < num_blocks < kPendingBlock.
  explicit BlockLedger(uint32_t num_blocks, uint64_t first_generation = 0);

  // `count` distinct free blocks, now allocated to `owner_epoch` and, when `ns` is given,
  // to that namespace (only such blocks can be committed). INVALID_ARGUMENT for count 0 or
  // owner_epoch 0; RESOURCE_EXHAUSTED when fewer are free. Ids come out 0, 1, 2, ... on a
  // fresh ledger; freed ids are reused first in, first out. With `generations`, it is set
  // to the fresh generation of each block, parallel to the ids. With `scrub`, it is set to
  // the blocks that may still hold another namespace's bytes (their last allocation was in
  // another namespace, or private while this one is not, or they were never allocated),
  // which the caller must overwrite before anyone reads them. `now_unix_ms` is recorded as
  // the allocation's start (FreeAllocatedBefore), and `allocator` (empty: none named) as the
  // principal that alone may commit the blocks (CommitChecks::committer).
  absl::StatusOr<std::vector<BlockId>> Allocate(uint32_t count, uint64_t owner_epoch,
                                                const NamespaceId* ns,
                                                std::vector<uint64_t>* generations = nullptr,
                                                std::vector<BlockId>* scrub = nullptr,
                                                int64_t now_unix_ms = 0,
                                                absl::string_view allocator = {});

  // Allocated blocks back to free, by their owner. INVALID_ARGUMENT for an empty list,
  // owner_epoch 0 or an id listed twice; OUT_OF_RANGE for an id past the pool;
  // FAILED_PRECONDITION for a free block (double free) or a committed one (it belongs to
  // the cache: the manager frees it); ABORTED for a block of another owner epoch. With
  // `generations` (empty: not checked), CheckGenerations first.
  absl::Status Free(std::span<const BlockId> ids, uint64_t owner_epoch,
                    std::span<const uint64_t> generations = {});

  // Commits `entries` in namespace `ns` for agent epoch `epoch`. A block already committed
  // to exactly this (ns, page, parent) in `epoch` is accepted as is (a repeated commit);
  // every other block must be allocated to `ns` and `epoch`. Returns the blocks this call
  // committed (not the repeated ones), in entry order. Errors name `field` (with the
  // entry's index): INVALID_ARGUMENT for an empty list, epoch 0, an id listed twice, an id
  // past the pool or kPendingBlock; FAILED_PRECONDITION for a block that is free, allocated
  // to another namespace or owner epoch, or committed to another page. The newly committed
  // blocks record `committed_unix_ms` as their commit time (a repeated commit keeps its
  // first time). With `checks`, a block to commit newly must also have been allocated by
  // checks.committer, when both name a principal (PERMISSION_DENIED otherwise), and have
  // checks.block_bytes written (FAILED_PRECONDITION otherwise).
  absl::StatusOr<std::vector<BlockId>> Commit(const NamespaceId& ns, uint64_t epoch,
                                              std::span<const CommitEntry> entries,
                                              absl::string_view field,
                                              int64_t committed_unix_ms = 0,
                                              const CommitChecks& checks = {});

  // Counts `bytes` more written into allocated block `id` (saturating). A range written
  // twice counts twice: the count stops a commit that races its writes, or names blocks its
  // committer never wrote, not an allocator committing its own half-written block (it
  // could as well write anything). REQUIRES: id < num_blocks; no-op unless allocated.
  void AddWritten(BlockId id, uint64_t bytes);
  uint64_t written(BlockId id) const { return slots_[id].written; }

  // The digest of committed block `id`'s bytes, taken at its commit (BlockPool, digests
  // on); 0 when none was taken. Set only on a committed block; a free clears it.
  void set_digest(BlockId id, uint64_t digest) { slots_[id].digest = digest; }
  uint64_t digest(BlockId id) const { return slots_[id].digest; }

  // Commits allocated block `target` (any namespace) to the page `source` holds, in
  // source's namespace, with source's commit time (a copy is as old as its data):
  // `target` received a copy of source's bytes (a demotion).
  // FAILED_PRECONDITION, changing nothing, unless `target` is allocated (not committed) to
  // source.owner_epoch. REQUIRES: source.ns != null, target < num_blocks.
  absl::Status CommitCopy(BlockId target, const CommittedBlock& source);

  // Committed blocks of `epoch` back to allocated (same namespace and owner): pages the
  // index did not take, which their allocator may write again or free. Errors as Free for
  // the list; FAILED_PRECONDITION for a block that is not committed in `epoch`.
  absl::Status Release(std::span<const BlockId> ids, uint64_t epoch, absl::string_view field);

  // Committed blocks of `epoch` back to free (the manager evicted their pages). Errors as
  // Release.
  absl::Status FreeCommitted(std::span<const BlockId> ids, uint64_t epoch, absl::string_view field);

  // OK when `ids` are distinct, inside the pool and allocated to or committed by
  // `owner_epoch` (readable); with `writable`, committed blocks are refused too. Errors
  // name `field`: INVALID_ARGUMENT for an empty list, owner_epoch 0, an id listed twice or
  // past the pool; FAILED_PRECONDITION for any other block.
  // With `generations` (empty: not checked), CheckGenerations first.
  absl::Status Check(std::span<const BlockId> ids, uint64_t owner_epoch, bool writable,
                     absl::string_view field, std::span<const uint64_t> generations = {}) const;

  // OK when block ids[i] is still in the allocation of generation generations[i], for every
  // i (nothing is checked for an empty `generations`, nor for an entry 0: "any").
  // INVALID_ARGUMENT "block_generations" unless there is one generation per id, or for one
  // no allocation had yet; OUT_OF_RANGE for an id past the pool; ABORTED
  // "<field>[i]: block 7 was freed ... since generation N" otherwise. The message never
  // says who holds the block now.
  absl::Status CheckGenerations(std::span<const BlockId> ids, std::span<const uint64_t> generations,
                                absl::string_view field) const;

  // OK when block ids[i] is committed in namespace `ns` to page pages[i], for every i (the
  // page a reader expects it to hold). ABORTED "<field>[i]: block 7 no longer holds page
  // <hex>" otherwise (freed, or reused for another page since the reader learned it);
  // INVALID_ARGUMENT unless pages is parallel to ids; OUT_OF_RANGE for an id past the pool.
  absl::Status CheckPages(std::span<const BlockId> ids, const NamespaceId& ns,
                          std::span<const PageHash> pages, absl::string_view field) const;

  // The generation of block `id`'s allocation; 0 for a free block. REQUIRES: id < num_blocks.
  uint64_t generation(BlockId id) const { return slots_[id].generation; }

  // Frees every block allocated to or committed by `owner_epoch`; returns how many.
  uint64_t FreeAllOwnedBy(uint64_t owner_epoch);

  // Blocks allocated (not committed) to `owner_epoch` for a namespace of `tenant`.
  uint64_t AllocatedToTenant(uint64_t owner_epoch, absl::string_view tenant) const;

  // Frees the blocks allocated (not committed) to `owner_epoch` for a namespace before
  // `cutoff_unix_ms`: stores whose worker died between Allocate and Insert. Their
  // generations end, so a late writer's calls answer ABORTED. Returns how many.
  uint64_t FreeAllocatedBefore(uint64_t owner_epoch, int64_t cutoff_unix_ms);

  // Calls fn for every committed block, in block order.
  void ForEachCommitted(absl::FunctionRef<void(const CommittedBlock&)> fn) const;

  // The committed block `id` (ns null when it is not committed). REQUIRES: id < num_blocks.
  CommittedBlock Committed(BlockId id) const;

  // The namespace block `id` was allocated to (committed blocks included); null for a free
  // block or one allocated without a namespace. REQUIRES: id < num_blocks.
  const NamespaceId* NamespaceOf(BlockId id) const;

  State state(BlockId id) const { return slots_[id].state; }
  uint32_t num_blocks() const { return static_cast<uint32_t>(slots_.size()); }
  uint32_t free_blocks() const { return static_cast<uint32_t>(free_.size()); }
  uint32_t committed_blocks() const { return committed_; }
  // Allocated and not committed.
  uint32_t allocated_blocks() const { return num_blocks() - free_blocks() - committed_; }

 private:
  static constexpr uint32_t kNoNamespace = 0xFFFFFFFF;
  static constexpr uint32_t kNever = 0xFFFFFFFE;
  static constexpr uint32_t kNoPrincipal = 0xFFFFFFFF;
  struct Slot {
    State state = State::kFree;
    uint32_t ns = kNoNamespace;  // index into namespaces_
    uint64_t owner_epoch = 0;
    PageHash page;
    PageHash parent;
    int64_t committed_unix_ms = 0;
    int64_t allocated_unix_ms = 0;  // when the allocation started (0: not recorded)
    uint64_t generation = 0;        // of the allocation; 0 while free
    // The namespace of the block's last allocation (kNoNamespace: private), kNever before
    // its first: kept while free, so that Allocate knows whose bytes the block holds.
    uint32_t last_ns = kNever;
    uint32_t allocator = kNoPrincipal;  // index into principals_
    uint64_t written = 0;               // bytes written since the allocation (AddWritten)
    uint64_t digest = 0;                // of a committed block's bytes; 0: none
  };

  // INVALID_ARGUMENT / OUT_OF_RANGE checks shared by every list-taking call.
  absl::Status CheckList(std::span<const BlockId> ids, uint64_t epoch, absl::string_view field,
                         absl::StatusCode past_pool) const;
  // Check (readable) plus every block committed: what Release and FreeCommitted require.
  absl::Status CheckCommitted(std::span<const BlockId> ids, uint64_t epoch,
                              absl::string_view field) const;
  uint32_t Intern(const NamespaceId& ns);
  void MakeFree(BlockId id);

  std::vector<Slot> slots_;
  // Free block ids; allocation pops from the front, frees push to the back (FIFO).
  std::deque<BlockId> free_;
  // The next allocation's generation; only grows.
  uint64_t next_generation_;
  uint32_t committed_ = 0;
  // Namespaces blocks were allocated to, by index; never shrinks (one entry per namespace
  // ever seen, not per block).
  std::deque<NamespaceId> namespaces_;  // a deque: CommittedBlock::ns points into it
  absl::flat_hash_map<NamespaceId, uint32_t> namespace_index_;
  // Principals that allocated blocks, by index; never shrinks (one per principal name, and
  // names come from the tokens file).
  std::vector<std::string> principals_;
  absl::flat_hash_map<std::string, uint32_t> principal_index_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_BLOCK_LEDGER_H_
