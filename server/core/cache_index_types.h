// The request and result values of CacheIndex's calls (matches, inserts, evictions, sweeps,
// stats). Plain structs; see cache_index.h for what each call does with them.
#ifndef KVCM_SERVER_CORE_CACHE_INDEX_TYPES_H_
#define KVCM_SERVER_CORE_CACHE_INDEX_TYPES_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "server/core/byte_budget.h"
#include "server/core/eviction_policy.h"
#include "server/core/lease_table.h"

namespace kvcm {

struct MatchOptions {
  // Agent the request will run on; its replicas are listed first. May be empty.
  std::string requester_agent_id;
  // Take a pin on the matched pages. Only a pinning match takes the index's lock
  // exclusively.
  bool pin = false;
  // 0 means CacheIndexOptions::default_lease_ttl.
  absl::Duration lease_ttl = absl::ZeroDuration();
  // No recency update, no pin, no counters.
  bool probe = false;
};

// A run of matched pages stored in the same pools; its replicas are
// MatchResult::replicas[first_replica, first_replica + num_replicas).
struct MatchedSegment {
  uint32_t first_page = 0;
  uint32_t num_pages = 0;
  uint32_t first_replica = 0;
  uint32_t num_replicas = 0;
};

// One pool's copy of a segment: its block ids (one per page of the segment) are
// MatchResult::block_ids[first_block, first_block + the segment's num_pages).
struct MatchedReplica {
  // Owned by the CacheIndex and valid for its lifetime (pools are never removed).
  const PoolKey* pool = nullptr;
  uint32_t first_block = 0;
};

// The result is flat (three arrays, whatever the number of segments and replicas) so that a
// match allocates a few times, not once per replica; read it through Replicas and BlockIds.
struct MatchResult {
  uint32_t matched_pages = 0;
  uint32_t prompt_pages = 0;
  uint32_t local_pages = 0;  // leading pages held by the requester's agent
  std::vector<MatchedSegment> segments;
  std::vector<MatchedReplica> replicas;  // by segment; the requester's agent first in each
  std::vector<BlockId> block_ids;
  PinId pin_id = 0;  // 0: no pin taken
  absl::Time lease_expiry = absl::InfinitePast();

  std::span<const MatchedReplica> Replicas(const MatchedSegment& seg) const {
    return std::span(replicas).subspan(seg.first_replica, seg.num_replicas);
  }
  std::span<MatchedReplica> Replicas(const MatchedSegment& seg) {
    return std::span(replicas).subspan(seg.first_replica, seg.num_replicas);
  }
  std::span<const BlockId> BlockIds(const MatchedSegment& seg, const MatchedReplica& rep) const {
    return std::span(block_ids).subspan(rep.first_block, seg.num_pages);
  }
};

struct InsertResult {
  uint32_t already_present_pages = 0;
  std::vector<BlockId> existing_block_ids;
  uint32_t new_pages = 0;
  uint32_t replicated_pages = 0;
  uint64_t evicted_bytes = 0;
};

struct InsertOptions {
  // Take the new pages' bytes out of the headroom ns's tenant reserved in the pool
  // (Reserve) first: the request that reserved them is now storing its pages.
  bool use_reservation = false;
  // Insert into an agent's pool after the agent committed the blocks (CommitBlocks):
  // newly_committed[i] says whether block_ids[i] was committed by that command rather than
  // earlier. Only such blocks may add a page to the pool; a page the pool lacks whose block
  // was committed earlier is FAILED_PRECONDITION naming block_ids[i] (the pool held it
  // once and evicted it: the block is on its way to being freed). Unset: an index-only
  // pool, no check. REQUIRES when set: one entry per page.
  std::optional<std::vector<bool>> newly_committed;
  // The pool's generation (PoolGeneration) when the agent was asked to commit: ABORTED,
  // nothing changed, when the pool has been dropped since (the agent's epoch ended, and the
  // blocks with it).
  std::optional<uint64_t> pool_generation;
  // When the new page-locations were committed (the CommitBlocks command's time, or the
  // agent ledger's for a rebuilt page): their age counts from it. Unset, or later than
  // now: now. Pages the pool already holds keep their own time.
  std::optional<absl::Time> committed_at;
  // Whether an Insert into a pool nobody registered may create it (index-only, with
  // default_pool_capacity_bytes). The service allows it to admins only: pools come from
  // agents, so no client can make up capacity.
  bool create_pool = true;
};

struct EvictResult {
  uint64_t evicted_bytes = 0;
  uint64_t evicted_pages = 0;
  // Of the evicted pages, those that moved to the agent's HOST pool instead of leaving.
  uint64_t demoted_pages = 0;
};

struct DropPoolResult {
  uint64_t dropped_pages = 0;  // page-locations the pool held
  uint64_t dropped_bytes = 0;
};

struct DeleteNamespaceResult {
  uint64_t removed_pages = 0;  // page-locations the namespace held
  uint64_t dropped_pins = 0;   // live pins on it
};

struct SweepResult {
  uint64_t removed_replicas = 0;  // by this call
  // Page-locations of dropped pools still in the tree: pinned ones wait for their pins.
  uint64_t remaining_pages = 0;
};

struct ExpirySweepResult {
  uint64_t expired_pages = 0;     // page-locations removed by this call
  uint64_t removed_replicas = 0;  // radix-node replicas they were in
  // The call stopped at max_steps before the end of its pass: call again.
  bool more = false;
};

struct NamespaceStats {
  NamespaceId ns;
  ModelSpec spec;
  uint64_t pages = 0;
  uint64_t page_locations = 0;
  uint64_t radix_nodes = 0;
  // The retention limit in force (the namespace's own or the manager's default, whichever
  // is shorter); 0: none.
  absl::Duration max_page_age = absl::ZeroDuration();
  uint64_t expired_pages = 0;  // page-locations removed for their age
  // IndexCounters' requested_tokens and matched_tokens, of this namespace's matches only.
  uint64_t requested_tokens = 0;
  uint64_t matched_tokens = 0;
};

struct IndexCounters {
  uint64_t match_requests = 0;  // non-probe matches
  uint64_t requested_pages = 0;
  uint64_t matched_pages = 0;
  uint64_t requested_tokens = 0;  // whole-page tokens of non-probe matches
  uint64_t matched_tokens = 0;    // = prefill tokens saved
  // Evicted pages asked for again (and missed) within CacheIndexOptions::regret_window of
  // leaving the index.
  uint64_t eviction_regret_pages = 0;
  uint64_t inserted_pages = 0;  // page-locations added
  uint64_t evicted_pages = 0;   // page-locations removed by eviction
  uint64_t evicted_bytes = 0;
  uint64_t demoted_pages = 0;  // evicted from a GPU pool into the agent's HOST pool
  uint64_t dropped_pages = 0;  // page-locations forgotten with their pool (DropPool)
  uint64_t expired_pages = 0;  // page-locations removed for their age (SweepExpired)
  uint64_t pins_taken = 0;
  uint64_t pins_released = 0;
  uint64_t lease_expiries = 0;
  // EvictForAllocation: agents' allocations it made room for, the page-locations it
  // evicted (also in evicted_pages), and those it refused (RESOURCE_EXHAUSTED).
  uint64_t allocation_room_calls = 0;
  uint64_t allocation_evicted_pages = 0;
  uint64_t allocation_room_refusals = 0;
};

// What one tenant holds, against CacheIndexOptions' quotas. Tenant "" holds the operators'
// reservations (Reserve with no tenant), which no quota limits.
struct TenantStats {
  std::string tenant;
  uint32_t namespaces = 0;
  uint64_t stored_bytes = 0;    // its page-locations in live pools
  uint64_t pinned_bytes = 0;    // of those, held by at least one pin
  uint64_t reserved_bytes = 0;  // headroom it reserved, in all pools
  uint64_t pins = 0;            // live pins
  uint64_t engine_pages = 0;    // page-locations in engine pools (max_engine_pages_per_tenant)
  // stored_bytes + reserved_bytes: what tenant_max_bytes limits.
  uint64_t held_bytes() const { return stored_bytes + reserved_bytes; }
};

struct IndexStats {
  std::vector<PoolStats> pools;
  std::vector<NamespaceStats> namespaces;
  // Every tenant with a namespace or a reservation, by name.
  std::vector<TenantStats> tenants;
  uint64_t tenant_max_bytes = 0;  // the quotas in force (0: unlimited)
  uint64_t tenant_max_pinned_bytes = 0;
  // The default share in force: 0 when it does not apply (a quota is set, or it is 100).
  // Each pool's cap in bytes is PoolStats::tenant_share_bytes.
  uint32_t default_tenant_pool_share_pct = 0;
  uint64_t max_engine_pages_per_engine = 0;
  uint64_t max_engine_pages_per_tenant = 0;
  IndexCounters counters;
  uint64_t active_pins = 0;
  std::string policy;
  // "select" only: its choice, its candidates' miniature hit rates, its sample.
  std::optional<SelectionStats> selection;
};

struct RegisterModelResult {
  ModelSpec spec;  // as stored
  HashKey hash_key;
  bool created = false;
  // The namespace's own retention limit, as registered (0: the manager's default), and
  // the limit in force (the shorter of the two; 0: none).
  absl::Duration registered_max_page_age = absl::ZeroDuration();
  absl::Duration max_page_age = absl::ZeroDuration();
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_CACHE_INDEX_TYPES_H_
