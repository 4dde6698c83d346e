// EvictionPolicy: orders the eviction candidates of each pool.
//
// A candidate is one replica (node, pool) that is an unpinned leaf of its pool: the node is
// unpinned and no child holds the pool. CacheIndex tells the policy when a replica becomes
// or stops being a candidate and when a node is accessed; the policy answers which
// candidate of a pool to evict next. Eviction frees whole nodes.
//
// Every policy here keeps one ordered set of candidates per pool, keyed by a score it
// stores in RadixNode::priority (lower goes first); policies differ only in the score.
//
// Not thread-safe: CacheIndex serialises access.
#ifndef KVCM_SERVER_CORE_EVICTION_POLICY_H_
#define KVCM_SERVER_CORE_EVICTION_POLICY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/core/radix_tree.h"
#include "server/core/types.h"

namespace kvcm {

// Tells the clairvoyant `opt` policy when a page will next be asked for. Only a simulator,
// which knows the whole trace, can implement it. Called under the index lock.
class NextUseOracle {
 public:
  virtual ~NextUseOracle() = default;
  // Logical time (for example the request index) of the first request after the one now
  // being served whose prompt includes `page`; UINT64_MAX when none does.
  virtual uint64_t NextUse(const PageHash& page) const = 0;
};

// What a policy may know besides the tree. Pointers may be null; not owned.
struct PolicyContext {
  // Required by "opt".
  const NextUseOracle* next_use = nullptr;
};

struct EvictionCandidate {
  RadixNode* node;
  PoolId pool;
};

// How a node was reached, for policies that count reuse.
enum class Access : uint8_t { kMatch, kInsert };

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  virtual absl::string_view name() const = 0;

  // (node, pool) became a candidate / stopped being one.
  void Add(RadixNode* node, PoolId pool) { SetOf(pool).emplace(node->priority, node); }
  void Remove(RadixNode* node, PoolId pool) { SetOf(pool).erase({node->priority, node}); }

  // `node` was on a matched or inserted path at logical time `stamp` (increasing). Updates
  // its recency and hit count and re-scores it.
  void Touch(RadixNode* node, uint64_t stamp, Access access);

  // Re-scores `node` after something its score depends on changed (a split, a replica
  // added or dropped), keeping its candidates in order.
  void Rescore(RadixNode* node);

  // `node`'s replica in `pool` is about to be evicted. REQUIRES: it is a candidate.
  virtual void OnEvict(const RadixNode& node, PoolId pool) {}

  // The candidate of `pool` to evict next, or nullopt when there is none.
  std::optional<EvictionCandidate> Victim(PoolId pool) const;

  // Rank of a candidate across pools (lower is evicted first); used when evicting from a
  // namespace rather than a pool.
  double Priority(const RadixNode* node, PoolId /*pool*/) const { return node->priority; }

 protected:
  // The node's sort key now. Called after last_access and hits are updated.
  virtual double Score(const RadixNode& node) const = 0;

 private:
  using Key = std::pair<double, RadixNode*>;
  absl::btree_set<Key>& SetOf(PoolId pool);

  std::vector<absl::btree_set<Key>> by_pool_;  // indexed by PoolId
};

// "lru": SGLang RadixCache's order. Every node on a matched or inserted path gets the same
// stamp; the least recently stamped candidate goes first.
std::unique_ptr<EvictionPolicy> MakeLruPolicy();

// "cost": keeps what saves the most prefill per byte. A GreedyDual-Size-Frequency score,
//   priority = L + hits * recompute_cost / (bytes * copies^2)
// where recompute_cost grows with the node's depth (attention over a longer prefix costs
// more), bytes are what evicting the replica frees (the model's bytes, so MLA pages are
// worth more per byte), copies is the node's replica count (dropping one of several copies
// loses a transfer, not a recompute), and L, the highest score evicted so far, ages every
// node not reused since (the decay).
std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy();

// "opt": Belady's clairvoyant order for the simulator: the candidate whose first page is
// needed furthest in the future goes first. REQUIRES: oracle != nullptr.
std::unique_ptr<EvictionPolicy> MakeOptPolicy(const NextUseOracle* oracle);

// Policy by name: "lru", "lru-mha" (LRU; CacheIndex charges MHA-shaped bytes for it),
// "cost" or "opt" (needs context.next_use). INVALID_ARGUMENT naming the known policies
// otherwise.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(
    absl::string_view name, const PolicyContext& context = {});

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_EVICTION_POLICY_H_
