// ByteBudget: capacity, used and pinned bytes of every pool (agent, tier).
//
// A page costs its namespace's bytes_per_page in every pool that holds it, so one pool
// shared by namespaces of different models is charged correctly (an MLA page of
// DeepSeek-V3 costs ~71x less than the same tokens in an MHA-shaped cache).
//
// Not thread-safe: CacheIndex serialises access.
#ifndef KVCM_SERVER_CORE_BYTE_BUDGET_H_
#define KVCM_SERVER_CORE_BYTE_BUDGET_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/types.h"

namespace kvcm {

struct PoolStats {
  PoolKey pool;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t pinned_bytes = 0;  // bytes of pages held by at least one pin
  // Headroom: bytes that admitted, unfinished work will still allocate (remaining decode,
  // queued prefills). Not used yet, but not free either.
  uint64_t reserved_bytes = 0;
  uint64_t pages = 0;  // page-locations in this pool
  // An engine's pool (CacheIndex::StoreEnginePages): the engine's events are its truth, so
  // the manager never evicts, expires or reserves it; capacity_bytes is 0 (the engine's own).
  bool engine = false;
  // Bytes one tenant may reserve and pin here by default_tenant_pool_share_pct; 0 when the
  // share does not apply (set by CacheIndex::Stats, not by the budget).
  uint64_t tenant_share_bytes = 0;
};

class ByteBudget {
 public:
  // Id of `pool`, creating it with `capacity_bytes` (an engine's pool when `engine`) if new.
  PoolId Intern(const PoolKey& pool, uint64_t capacity_bytes, bool engine = false);
  // The live id of `pool`; a retired id is never returned.
  std::optional<PoolId> Find(const PoolKey& pool) const;
  size_t size() const { return pools_.size(); }

  // Retires `id` and gives its key a fresh id with the same capacity and reservation, which
  // it returns. The retired id keeps its usage (its pages leave as the index sweeps them)
  // and stays valid, but Find no longer returns it. REQUIRES: !retired(id).
  PoolId Replace(PoolId id);
  // Retires `id` with no successor: Find no longer returns its key (an Intern makes it anew,
  // empty), and its reservation is cleared. REQUIRES: !retired(id).
  void Retire(PoolId id);
  bool retired(PoolId id) const { return retired_[id] != 0; }
  bool engine(PoolId id) const { return pools_[id].engine; }

  // Valid for the budget's lifetime: pools are never removed.
  const PoolKey& key(PoolId id) const { return pools_[id].pool; }
  const PoolStats& stats(PoolId id) const { return pools_[id]; }
  uint64_t capacity(PoolId id) const { return pools_[id].capacity_bytes; }
  uint64_t used(PoolId id) const { return pools_[id].used_bytes; }
  uint64_t pinned(PoolId id) const { return pools_[id].pinned_bytes; }
  uint64_t reserved(PoolId id) const { return pools_[id].reserved_bytes; }
  // Bytes neither used nor reserved (0 when over capacity after a capacity cut).
  uint64_t free(PoolId id) const {
    const PoolStats& p = pools_[id];
    const uint64_t taken = p.used_bytes + p.reserved_bytes;
    return p.capacity_bytes > taken ? p.capacity_bytes - taken : 0;
  }
  // Unpinned bytes, all of which eviction can reach (pins cover whole root paths, so an
  // unpinned page never has a pinned descendant).
  uint64_t evictable(PoolId id) const { return pools_[id].used_bytes - pools_[id].pinned_bytes; }
  // Bytes to evict before `need` more fit: max(0, need - free). Exactly the shortfall.
  uint64_t Shortfall(PoolId id, uint64_t need) const {
    uint64_t f = free(id);
    return need > f ? need - f : 0;
  }

  void SetCapacity(PoolId id, uint64_t capacity_bytes) {
    pools_[id].capacity_bytes = capacity_bytes;
  }
  void Charge(PoolId id, uint64_t pages, uint64_t bytes) {
    pools_[id].pages += pages;
    pools_[id].used_bytes += bytes;
  }
  void Refund(PoolId id, uint64_t pages, uint64_t bytes) {
    pools_[id].pages -= pages;
    pools_[id].used_bytes -= bytes;
  }
  void Pin(PoolId id, uint64_t bytes) { pools_[id].pinned_bytes += bytes; }
  void Reserve(PoolId id, uint64_t bytes) { pools_[id].reserved_bytes += bytes; }
  void Unreserve(PoolId id, uint64_t bytes) { pools_[id].reserved_bytes -= bytes; }
  void Unpin(PoolId id, uint64_t bytes) { pools_[id].pinned_bytes -= bytes; }

 private:
  // Indexed by PoolId. A deque, so that key(id) references stay valid as pools are added:
  // match results point at them instead of copying the agent id.
  std::deque<PoolStats> pools_;
  std::vector<uint8_t> retired_;              // by PoolId; a byte each, read on the match path
  absl::flat_hash_map<PoolKey, PoolId> ids_;  // live ids only
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_BYTE_BUDGET_H_
