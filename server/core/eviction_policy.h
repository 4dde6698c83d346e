// EvictionPolicy: orders the eviction candidates of each pool.
//
// A candidate is one replica (node, pool) that is an unpinned leaf of its pool: the node is
// unpinned and no child holds the pool. CacheIndex tells the policy when a replica becomes
// or stops being a candidate and when a node is accessed; the policy answers which
// candidate of a pool to evict next. Eviction frees whole nodes.
//
// Not thread-safe: CacheIndex serialises access.
#ifndef KVCM_SERVER_CORE_EVICTION_POLICY_H_
#define KVCM_SERVER_CORE_EVICTION_POLICY_H_

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/core/radix_tree.h"
#include "server/core/types.h"

namespace kvcm {

struct EvictionCandidate {
  RadixNode* node;
  PoolId pool;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  virtual absl::string_view name() const = 0;

  // (node, pool) became a candidate / stopped being one.
  virtual void Add(RadixNode* node, PoolId pool) = 0;
  virtual void Remove(RadixNode* node, PoolId pool) = 0;

  // `node` was on a matched or inserted path at logical time `stamp` (increasing). The
  // policy updates node->last_access and reorders the node's candidates.
  virtual void Touch(RadixNode* node, uint64_t stamp) = 0;

  // The candidate of `pool` to evict next, or nullopt when there is none.
  virtual std::optional<EvictionCandidate> Victim(PoolId pool) const = 0;

  // Rank of a candidate across pools (lower is evicted first); used when evicting from a
  // namespace rather than a pool.
  virtual double Priority(const RadixNode* node, PoolId pool) const = 0;
};

// "lru": SGLang RadixCache's order. Every node on a matched or inserted path gets the same
// stamp; the least recently stamped candidate goes first.
std::unique_ptr<EvictionPolicy> MakeLruPolicy();

// Policy by name; INVALID_ARGUMENT naming the known policies otherwise.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(absl::string_view name);

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_EVICTION_POLICY_H_
