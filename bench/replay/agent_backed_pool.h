// AgentBackedPools: the agent pools of one replay CacheIndex, each backed by a real
// BlockLedger (gpu/agent/pool/block_ledger.h) in process, so that a request stores its pages
// the way an inference worker does (issue 33) instead of by an index-only Insert.
//
// What it mirrors, with every command carried out at once and in order (an agent that never
// lags, a manager that gets every ack before its next call):
//   - the worker's store (the vLLM connector's _store / _insert, client/python/kvcm/vllm/
//     connector.py): blocks only for the pages its agent's pool lacks, allocated to the
//     namespace with the agent's epoch as owner; when the agent is short, the manager makes
//     room (AgentControl.MakeRoom: CacheIndex::EvictForAllocation) and the Allocate is tried
//     again; the write is a no-op (the ledger is what is tested, not the bytes); duplicates
//     the Insert reports are freed.
//   - the manager's Insert into an agent pool (server/core/agent_inserter.cc): CommitBlocks on
//     the ledger (each page's parent is the page before it), Insert with newly_committed,
//     pool_generation and committed_at, ReleaseBlocks for what the index refused or held
//     with another block.
//   - the manager's event listener (server/core/block_command_issuer.cc), with the agent's
//     side of each command as gpu/agent/control/command_executor.cc runs it: FreeBlocks
//     (FreeCommitted) for a kRemoved event, DemoteBlocks (Allocate on the HOST ledger,
//     CommitCopy) for a demotion, then AssignBlocks, freeing what it returns, or
//     AbandonPending when the agent could not copy.
//
// Not thread-safe; one replay drives it.
#ifndef KVCM_BENCH_REPLAY_AGENT_BACKED_POOL_H_
#define KVCM_BENCH_REPLAY_AGENT_BACKED_POOL_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "gpu/agent/pool/block_ledger.h"
#include "server/core/cache_index.h"

namespace kvcm::bench {

// What the agent path did, summed over a replay's pools.
struct AgentPathCounters {
  uint64_t stores = 0;             // stores that allocated blocks (the pool lacked pages)
  uint64_t short_allocations = 0;  // first Allocate answered RESOURCE_EXHAUSTED
  uint64_t room_refusals = 0;      // EvictForAllocation answered RESOURCE_EXHAUSTED
  uint64_t insert_refusals = 0;    // Insert answered RESOURCE_EXHAUSTED after the commit
  uint64_t freed_blocks = 0;       // FreeCommitted for kRemoved events
  uint64_t released_blocks = 0;    // freed by the worker: duplicates and refused inserts' blocks
  uint64_t demotions = 0;          // DemoteBlocks the agent carried out
  uint64_t failed_demotions = 0;   // DemoteBlocks it could not (AbandonPending)
  uint64_t checks = 0;             // Check calls
  uint64_t full_checks = 0;        // of which full
};

class AgentBackedPools {
 public:
  // The owner epoch of every block (one agent incarnation for the whole replay).
  static constexpr uint64_t kEpoch = 1;

  // Becomes `index`'s event listener. `index` is not owned and must outlive this object.
  explicit AgentBackedPools(CacheIndex* index);
  ~AgentBackedPools();  // stops listening
  AgentBackedPools(const AgentBackedPools&) = delete;
  AgentBackedPools& operator=(const AgentBackedPools&) = delete;

  // Backs `pool` (a pool of the index, empty) with a ledger of `num_blocks` blocks.
  // INVALID_ARGUMENT for 0 blocks or a pool backed already.
  absl::Status AddPool(const PoolKey& pool, uint32_t num_blocks);

  // The worker's store of prompt `pages` (a prompt's leading pages) of `ns` into backed pool
  // `pool`, after `match`, a pinning Match of `pages` on this index (the pool's leading pages
  // it lists are the blocks the worker already holds). Returns whether the pages are indexed:
  // false when the manager could not make room (EvictForAllocation) or the Insert was
  // refused, RESOURCE_EXHAUSTED both, and then every block allocated is free again. Any other
  // error is the index's or the ledger's, and ends the replay.
  absl::StatusOr<bool> Store(const NamespaceId& ns, std::span<const PageHash> pages,
                             const PoolKey& pool, const MatchResult& match);

  // INTERNAL, naming the pool, unless every ledger holds as many committed blocks as the index
  // has page-locations in its pool, and the request's own pages (the last Store's) sit in
  // committed blocks of those pages. With `full`, also that every committed block is the
  // index's block of its page in that pool (a probe Match per chain: O(pages held)), so that
  // no indexed block is free and no committed block is unknown to the index. Also any error
  // an event left (a FreeCommitted the ledger refused).
  absl::Status Check(bool full);

  const AgentPathCounters& counters() const { return counters_; }

 private:
  struct Pool {
    Pool(const PoolKey& k, uint32_t num_blocks)
        : key(k), ledger(num_blocks, /*first_generation=*/1) {}
    PoolKey key;
    BlockLedger ledger;
  };
  // A DemoteBlocks the agent answered, for the index once its call returns.
  struct Demotion {
    NamespaceId ns;
    PoolKey pool;                // the HOST pool
    std::vector<PageHash> path;  // a prompt's leading pages, ending with the demoted ones
    uint32_t first_page = 0;
    std::vector<BlockId> blocks;  // the HOST blocks, parallel to path[first_page..]; empty: failed
  };

  void OnEvent(const CacheEvent& event);
  void Demote(const CacheEvent& event);
  // Hands the answered demotions to the index (AssignBlocks / AbandonPending).
  void Settle();
  Pool* Find(const PoolKey& pool);
  absl::StatusOr<uint64_t> BytesPerPage(const NamespaceId& ns);
  absl::Status FullCheck(const Pool& pool) const;
  // Keeps the first error an event handler met.
  void Fail(absl::Status status);

  CacheIndex* const index_;
  absl::flat_hash_map<PoolKey, std::unique_ptr<Pool>> pools_;
  absl::flat_hash_map<NamespaceId, uint64_t> bytes_per_page_;
  std::deque<Demotion> answered_;
  absl::Status error_;
  // The last Store's prompt and blocks, for Check.
  NamespaceId last_ns_;
  Pool* last_pool_ = nullptr;
  std::vector<PageHash> last_pages_;
  std::vector<BlockId> last_blocks_;
  AgentPathCounters counters_;
};

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_AGENT_BACKED_POOL_H_
