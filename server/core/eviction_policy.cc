#include "server/core/eviction_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/core/eviction_policy_internal.h"

namespace kvcm {

void EvictionPolicy::Touch(RadixNode* node, uint64_t stamp, double now_s, Access access) {
  if (node->last_access == stamp) return;
  OnTouch(*node, now_s, access);
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

using policy_internal::IsCandidate;
using policy_internal::WorthPerByte;

// A node another pool also holds goes before every node that is the only copy: losing it
// costs a transfer, not a recompute. Subtracted from such nodes' scores: more seconds than
// any clock in use reads since the Unix epoch (about 1.8e9 now), so those nodes sort first.
constexpr double kReplicatedFirst = 1e12;

// Decay of the adaptive policy's counts per event: they cover about the last 1,024 events,
// a count, not a time.
constexpr double kCountDecay = 1.0 - 1.0 / 1024;

// Reuses that count for credit: beyond ten add nothing, so that a once-popular node cannot
// stay forever.
double CountedReuses(const RadixNode& node) {
  constexpr uint32_t kMaxReuses = 10;
  return std::min<uint32_t>(node.hits > 0 ? node.hits - 1 : 0, kMaxReuses);
}

// The "cost" score with `credit_s` seconds per reuse: replicated nodes first (least
// recently used first among them), then by last access plus the credit of the reuses.
double CreditedScore(const RadixNode& node, double credit_s) {
  if (node.replicas.size() > 1) return node.last_access_s - kReplicatedFirst;
  const double reuses = CountedReuses(node);
  if (reuses == 0) return node.last_access_s;
  return node.last_access_s + credit_s * reuses * WorthPerByte(node);
}

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
  explicit CostAwarePolicy(absl::Duration reuse_credit)
      : reuse_credit_s_(absl::ToDoubleSeconds(reuse_credit)) {}
  absl::string_view name() const override { return "cost"; }
  bool trims_nodes() const override { return true; }
  bool demotes_to_host() const override { return true; }

 protected:
  double Score(const RadixNode& node) const override {
    return CreditedScore(node, reuse_credit_s_);
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

// "opt-whether": knows whether a node will be used again, not when; least recently used
// first within each of the two groups. What a perfect predictor of reuse could reach.
class OptWhetherPolicy final : public EvictionPolicy {
 public:
  explicit OptWhetherPolicy(const NextUseOracle* oracle) : oracle_(oracle) {}
  absl::string_view name() const override { return "opt-whether"; }
  bool trims_nodes() const override { return true; }

 protected:
  double Score(const RadixNode& node) const override {
    const bool again = oracle_->NextUse(node.pages.front()) != std::numeric_limits<uint64_t>::max();
    return node.last_access_s + (again ? kReplicatedFirst : 0);
  }

 private:
  const NextUseOracle* const oracle_;
};

}  // namespace

AdaptivePolicy::AdaptivePolicy(const AdaptiveParams& params)
    : params_(params),
      credit_(std::clamp(params.initial_credit, params.min_credit, params.max_credit)) {}

void AdaptivePolicy::SampleReuse(double interval_s) {
  // The mean of the first samples, then a moving mean over about the last 256: a count, not
  // a time, so it follows the workload's own pace.
  constexpr double kWindow = 256;
  ++samples_;
  reuse_interval_s_ += (std::max(0.0, interval_s) - reuse_interval_s_) /
                       std::min<double>(static_cast<double>(samples_), kWindow);
}

void AdaptivePolicy::Adapt() {
  // Credit is worth its space when a node it keeps past the eviction age is reused more
  // often than a run without reuse, evicted to make that space, would have been.
  const double kept = credit_kept_hit_ + credit_kept_vain_;
  if (kept <= 0 || once_evicted_ <= 0) return;
  const double kept_rate = credit_kept_hit_ / kept;
  const double once_rate = once_regretted_ / once_evicted_;
  credit_ += kept_rate > once_rate ? params_.step : -params_.step;
  credit_ = std::clamp(credit_, params_.min_credit, params_.max_credit);
}

void AdaptivePolicy::OnTouch(const RadixNode& node, double now_s, Access access) {
  // A match of a candidate (a leaf of some pool): the reuses eviction decides about. Inner
  // nodes (shared prompts) are matched far more often and would drown them.
  if (access != Access::kMatch || node.hits == 0 || !IsCandidate(node)) return;
  const double age = now_s - node.last_access_s;
  SampleReuse(age);
  if (CountedReuses(node) > 0 && age_samples_ > 0 && age > eviction_age_s_) {
    credit_kept_hit_ = credit_kept_hit_ * kCountDecay + 1;
    credit_kept_vain_ *= kCountDecay;
    Adapt();
  }
}

uint8_t AdaptivePolicy::OnGhostAdded(const RadixNode& node, double now_s) {
  const double age = std::max(0.0, now_s - node.last_access_s);
  if (CountedReuses(node) > 0) {
    if (age_samples_ > 0 && age > eviction_age_s_) {
      credit_kept_vain_ = credit_kept_vain_ * kCountDecay + 1;
      credit_kept_hit_ *= kCountDecay;
      Adapt();
    }
    return 0;
  }
  once_evicted_ = once_evicted_ * kCountDecay + 1;
  once_regretted_ *= kCountDecay;
  // Running mean over about the last 64 such evictions.
  constexpr double kWindow = 64;
  ++age_samples_;
  eviction_age_s_ +=
      (age - eviction_age_s_) / std::min<double>(static_cast<double>(age_samples_), kWindow);
  return 0;
}

void AdaptivePolicy::OnGhostHit(const RadixNode& /*leaf*/, const GhostHit& ghost, double now_s) {
  // A reuse the cache did not keep for: its interval counts too, or the mean would only
  // see what the cache was already big enough for.
  SampleReuse(now_s - ghost.last_access_s);
  if (ghost.hits <= 1) {
    once_regretted_ += 1;
    Adapt();
  }
}

double AdaptivePolicy::Score(const RadixNode& node) const {
  return CreditedScore(node, credit_ * reuse_interval_s_);
}

std::unique_ptr<AdaptivePolicy> MakeAdaptivePolicy(const AdaptiveParams& params) {
  return std::make_unique<AdaptivePolicy>(params);
}

std::unique_ptr<EvictionPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>("lru"); }

std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(absl::Duration reuse_credit) {
  return std::make_unique<CostAwarePolicy>(reuse_credit);
}

std::unique_ptr<EvictionPolicy> MakeOptPolicy(const NextUseOracle* oracle) {
  return std::make_unique<OptPolicy>(oracle);
}

std::unique_ptr<EvictionPolicy> MakeLruMhaPolicy() {
  return std::make_unique<LruPolicy>("lru-mha");
}

std::unique_ptr<EvictionPolicy> MakeOptWhetherPolicy(const NextUseOracle* oracle) {
  return std::make_unique<OptWhetherPolicy>(oracle);
}

}  // namespace kvcm
