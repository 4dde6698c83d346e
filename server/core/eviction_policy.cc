#include "server/core/eviction_policy.h"

#include <tuple>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

// One ordered set per pool of (last_access, node) candidates. A node's stamp only changes
// in Touch, which re-keys its candidates, so the set stays sorted by stamp.
class LruPolicy final : public EvictionPolicy {
 public:
  absl::string_view name() const override { return "lru"; }

  void Add(RadixNode* node, PoolId pool) override {
    SetOf(pool).insert(Key{node->last_access, node});
  }

  void Remove(RadixNode* node, PoolId pool) override {
    SetOf(pool).erase(Key{node->last_access, node});
  }

  void Touch(RadixNode* node, uint64_t stamp) override {
    if (node->last_access == stamp) return;
    for (const Replica& r : node->replicas) {
      if (r.evictable) Remove(node, r.pool);
    }
    node->last_access = stamp;
    for (const Replica& r : node->replicas) {
      if (r.evictable) Add(node, r.pool);
    }
  }

  std::optional<EvictionCandidate> Victim(PoolId pool) const override {
    if (pool >= by_pool_.size() || by_pool_[pool].empty()) return std::nullopt;
    return EvictionCandidate{std::get<1>(*by_pool_[pool].begin()), pool};
  }

  double Priority(const RadixNode* node, PoolId) const override {
    return static_cast<double>(node->last_access);
  }

 private:
  using Key = std::tuple<uint64_t, RadixNode*>;

  absl::btree_set<Key>& SetOf(PoolId pool) {
    if (pool >= by_pool_.size()) by_pool_.resize(pool + 1);
    return by_pool_[pool];
  }

  std::vector<absl::btree_set<Key>> by_pool_;  // indexed by PoolId
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>(); }

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(absl::string_view name) {
  if (name == "lru") return MakeLruPolicy();
  return absl::InvalidArgumentError(
      absl::StrCat("policy \"", name, "\" is unknown; known policies: lru"));
}

}  // namespace kvcm
