#include "server/core/eviction_policy.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvcm {

void EvictionPolicy::Touch(RadixNode* node, uint64_t stamp, double now_s, Access access) {
  if (node->last_access == stamp) return;
  Rekey(node, [&] {
    node->last_access = stamp;
    node->last_access_s = now_s;
    if (access == Access::kMatch || node->hits == 0) ++node->hits;
  });
}

void EvictionPolicy::Rescore(RadixNode* node) {
  Rekey(node, [] {});
}

template <typename Update>
void EvictionPolicy::Rekey(RadixNode* node, Update update) {
  // Candidates are found by their key, so they leave the sets before it changes.
  for (const Replica& r : node->replicas) {
    if (r.evictable) Remove(node, r.pool);
  }
  update();
  node->priority = Score(*node);
  for (const Replica& r : node->replicas) {
    if (r.evictable) Add(node, r.pool);
  }
}

std::optional<EvictionCandidate> EvictionPolicy::Victim(PoolId pool) const {
  if (pool >= by_pool_.size() || by_pool_[pool].empty()) return std::nullopt;
  return EvictionCandidate{std::get<2>(*by_pool_[pool].begin()), pool};
}

std::optional<EvictionCandidate> EvictionPolicy::GroupVictim(uint32_t group) const {
  auto it = by_group_.find(group);
  if (it == by_group_.end()) return std::nullopt;
  const GroupKey& first = *it->second.begin();
  return EvictionCandidate{std::get<2>(first), std::get<3>(first)};
}

void EvictionPolicy::AddToGroup(RadixNode* node, PoolId pool) {
  by_group_[node->tree->group()].insert({node->priority, node->last_access, node, pool});
}

void EvictionPolicy::RemoveFromGroup(RadixNode* node, PoolId pool) {
  auto it = by_group_.find(node->tree->group());
  if (it == by_group_.end()) return;
  it->second.erase({node->priority, node->last_access, node, pool});
  if (it->second.empty()) by_group_.erase(it);
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
  // Subtracted from the score of a node with another copy: more seconds than any clock in
  // use reads since the Unix epoch (about 1.8e9 now), so those nodes sort first.
  static constexpr double kReplicatedFirst = 1e12;

  explicit CostAwarePolicy(absl::Duration reuse_credit)
      : reuse_credit_s_(absl::ToDoubleSeconds(reuse_credit)) {}
  absl::string_view name() const override { return "cost"; }
  bool trims_nodes() const override { return true; }
  bool demotes_to_host() const override { return true; }

 protected:
  double Score(const RadixNode& node) const override {
    // Reuses beyond ten add nothing, so that a once-popular node cannot stay forever.
    constexpr uint32_t kMaxReuses = 10;
    // A node another pool also holds goes before every node that is the only copy: losing
    // it costs a transfer, not a recompute. Among such nodes, least recently used first.
    if (node.replicas.size() > 1) return node.last_access_s - kReplicatedFirst;
    const double reuses = std::min<uint32_t>(node.hits > 0 ? node.hits - 1 : 0, kMaxReuses);
    if (reuses == 0) return node.last_access_s;
    // Recompute cost saved per byte: prefill cost is taken as the same for every token
    // (weighting it by position, since attention grows with the prefix, lost 1-5 points
    // on the Mooncake trace: deep conversation tails are not reused more), so it is the
    // inverse of the model's bytes per token,
    // relative to DeepSeek-V3's MLA latent in bf16 (70,272 B per token).
    constexpr double kReferenceBytesPerToken = 70272;
    const double bytes_per_token =
        static_cast<double>(node.tree->bytes_per_page()) / node.tree->page_size_tokens();
    const double per_byte = std::clamp(kReferenceBytesPerToken / bytes_per_token, 0.125, 8.0);
    return node.last_access_s + reuse_credit_s_ * reuses * per_byte;
  }

 private:
  const double reuse_credit_s_;
};

class OptPolicy final : public EvictionPolicy {
 public:
  explicit OptPolicy(const NextUseOracle* oracle) : oracle_(oracle) {}
  absl::string_view name() const override { return "opt"; }
  bool trims_nodes() const override { return true; }

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

std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(absl::Duration reuse_credit) {
  return std::make_unique<CostAwarePolicy>(reuse_credit);
}

std::unique_ptr<EvictionPolicy> MakeOptPolicy(const NextUseOracle* oracle) {
  return std::make_unique<OptPolicy>(oracle);
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(absl::string_view name,
                                                                   const PolicyContext& context) {
  if (name == "lru") return MakeLruPolicy();
  if (name == "lru-mha") return std::make_unique<LruPolicy>("lru-mha");
  if (name == "cost") return MakeCostAwarePolicy(context.reuse_credit);
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
