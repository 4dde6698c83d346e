#include "server/core/eviction_policy.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvcm {

void EvictionPolicy::Touch(RadixNode* node, uint64_t stamp, Access access) {
  if (node->last_access == stamp) return;
  node->last_access = stamp;
  if (access == Access::kMatch || node->hits == 0) ++node->hits;
  Rescore(node);
}

void EvictionPolicy::Rescore(RadixNode* node) {
  const double score = Score(*node);
  if (score == node->priority) return;
  for (const Replica& r : node->replicas) {
    if (r.evictable) Remove(node, r.pool);
  }
  node->priority = score;
  for (const Replica& r : node->replicas) {
    if (r.evictable) Add(node, r.pool);
  }
}

std::optional<EvictionCandidate> EvictionPolicy::Victim(PoolId pool) const {
  if (pool >= by_pool_.size() || by_pool_[pool].empty()) return std::nullopt;
  return EvictionCandidate{by_pool_[pool].begin()->second, pool};
}

absl::btree_set<EvictionPolicy::Key>& EvictionPolicy::SetOf(PoolId pool) {
  if (pool >= by_pool_.size()) by_pool_.resize(pool + 1);
  return by_pool_[pool];
}

namespace {

class LruPolicy final : public EvictionPolicy {
 public:
  explicit LruPolicy(absl::string_view name) : name_(name) {}
  absl::string_view name() const override { return name_; }

 protected:
  // Stamps are below 2^53 for any realistic run, so the double is exact.
  double Score(const RadixNode& node) const override {
    return static_cast<double>(node.last_access);
  }

 private:
  const absl::string_view name_;
};

class CostAwarePolicy final : public EvictionPolicy {
 public:
  absl::string_view name() const override { return "cost"; }

  void OnEvict(const RadixNode& node, PoolId /*pool*/) override {
    inflation_ = std::max(inflation_, node.priority);
  }

 protected:
  double Score(const RadixNode& node) const override {
    // Prefill FLOPs of a token grow linearly with its position (the attention part); in
    // units of "one token at position 0", a token at position p costs 1 + p / kContext.
    // Summed over the node's pages, with p in pages.
    constexpr double kContextPages = 64.0;  // 4K tokens of 64: attention ~ the MLPs there
    const double first = node.depth_pages, n = node.size();
    const double recompute = n * (1.0 + (first + (n - 1) / 2.0) / kContextPages);
    const double bytes = n * static_cast<double>(node.tree->bytes_per_page());
    // Another copy elsewhere makes this one cheap to drop: a transfer replaces the
    // recompute. Weighted down by the number of copies.
    const double copies = std::max<size_t>(1, node.replicas.size());
    const double value = node.hits * recompute / (bytes * copies * copies);
    // Scaled so that one reuse of a typical page is worth about one unit of inflation.
    return inflation_ + value * kScale;
  }

 private:
  static constexpr double kScale = 1e6;  // bytes per page are ~1e5..1e7
  // L: the highest score evicted so far. Raising the floor of newly scored nodes is what
  // ages the ones not touched since.
  double inflation_ = 0;
};

class OptPolicy final : public EvictionPolicy {
 public:
  explicit OptPolicy(const NextUseOracle* oracle) : oracle_(oracle) {}
  absl::string_view name() const override { return "opt"; }

 protected:
  // Furthest next use first: the score is minus the next use.
  double Score(const RadixNode& node) const override {
    const uint64_t next = oracle_->NextUse(node.pages.front());
    return next == std::numeric_limits<uint64_t>::max() ? -std::numeric_limits<double>::max()
                                                        : -static_cast<double>(next);
  }

 private:
  const NextUseOracle* const oracle_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>("lru"); }

std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy() {
  return std::make_unique<CostAwarePolicy>();
}

std::unique_ptr<EvictionPolicy> MakeOptPolicy(const NextUseOracle* oracle) {
  return std::make_unique<OptPolicy>(oracle);
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(absl::string_view name,
                                                                   const PolicyContext& context) {
  if (name == "lru") return MakeLruPolicy();
  if (name == "lru-mha") return std::make_unique<LruPolicy>("lru-mha");
  if (name == "cost") return MakeCostAwarePolicy();
  if (name == "opt") {
    if (context.next_use == nullptr) {
      return absl::InvalidArgumentError(
          "policy \"opt\" is clairvoyant and needs a next-use oracle (simulator only)");
    }
    return MakeOptPolicy(context.next_use);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("policy \"", name, "\" is unknown; known policies: lru, lru-mha, cost, opt"));
}

}  // namespace kvcm
