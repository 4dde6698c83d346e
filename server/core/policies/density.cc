// "density": eviction by hit density, learnt online. See eviction_policy.h and
// docs/EVICTION.md ("Hit density").
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "server/core/eviction_policy.h"
#include "server/core/policies/policy_internal.h"

namespace kvcm {
namespace {

using policy_internal::IsCandidate;
using policy_internal::WorthPerByte;

// Reuse classes at most (DensityParams::reuse_classes).
constexpr uint32_t kReuseClasses = 4;
// Groups of trees (tenants) with their own statistics; the rest share the last slot.
constexpr uint32_t kMaxGroups = 64;
// Ages in powers of two from about a millisecond: bucket 0 is [0, kAgeUnit), bucket b
// is [kAgeUnit * 2^(b-1), kAgeUnit * 2^b), the last one open-ended (past 12 days).
// Log-spaced, so no time scale of a workload is built in.
constexpr double kAgeUnit = 1.0 / 1024;
constexpr int kAgeBuckets = 41;
// The ranking is recomputed every kRankEvery events (hits and evictions), and the counts
// then decay by kDecay, so they cover about the last kRankEvery / (1 - kDecay) events:
// a count, not a time.
constexpr uint64_t kRankEvery = 512;
constexpr double kDecay = 0.95;
// Class offsets in the sort key: scores are class * kClassSpan + last_access_s, so one
// pool's candidates sort by class, then least recently used first. Replicated nodes sort
// below every class. Clock readings stay far below kClassSpan (about 1.8e9 s now).
constexpr double kClassSpan = 1e10;
constexpr double kReplicated = -1e13;

int AgeBucket(double age_s) {
  if (!(age_s >= kAgeUnit)) return 0;
  return std::min(std::ilogb(age_s / kAgeUnit) + 1, kAgeBuckets - 1);
}
double BucketLow(int b) { return b == 0 ? 0 : kAgeUnit * std::ldexp(1.0, b - 1); }
double BucketHigh(int b) {
  return b == kAgeBuckets - 1 ? std::numeric_limits<double>::infinity()
                              : kAgeUnit * std::ldexp(1.0, b);
}
double BucketMid(int b) { return b == 0 ? kAgeUnit / 2 : 0.75 * kAgeUnit * std::ldexp(1.0, b); }

// A node's reuse class: how often it was used (1, 2, 3, 4+), folded into `classes`.
uint32_t ReuseClass(uint32_t hits, uint32_t classes) {
  const uint32_t uses = std::max<uint32_t>(hits, 1);
  return std::min(uses, classes) - 1;
}

class HitDensityPolicy final : public EvictionPolicy {
 public:
  explicit HitDensityPolicy(const DensityParams& params) : params_(params) {}
  absl::string_view name() const override { return "density"; }
  bool trims_nodes() const override { return true; }
  bool demotes_to_host() const override { return true; }

  uint64_t OnGhostAdded(const RadixNode& node, double now_s) override {
    Observe(now_s);
    const uint8_t tag = last_choice_;
    last_choice_ = kNoExpert;
    for (int e = 0; e < 2; ++e) {
      if (tag & (1 << e)) expert_evicted_[e] += node.size();
    }
    // Counted as the end of a life without reuse; a ghost hit later turns it into a reuse.
    Stats(ClassOf(node.tree->group(), node.hits)).ended[AgeBucket(now_s - node.last_access_s)] +=
        node.size();
    Event();
    return tag;
  }

  void OnGhostHit(const RadixNode& leaf, const GhostHit& ghost, double now_s) override {
    Observe(now_s);
    // Had it been kept, it would have been hit at this age: move its end there.
    ClassStats& s = Stats(ClassOf(leaf.tree->group(), ghost.hits));
    double& ended = s.ended[AgeBucket(ghost.evicted_s - ghost.last_access_s)];
    const double pages = std::min(ghost.pages, leaf.size());
    for (int e = 0; e < 2; ++e) {
      if (ghost.tag & (1 << e)) expert_regretted_[e] += pages;
    }
    ended = std::max(0.0, ended - pages);
    s.reused[AgeBucket(now_s - ghost.last_access_s)] += pages;
    Event();
  }

  std::optional<EvictionCandidate> Victim(PoolId pool) const override;

  // Which expert chose a victim: bits of its ghost's tag.
  static constexpr uint8_t kNoExpert = 0, kDensityExpert = 1, kLruExpert = 2;

 protected:
  void OnTouch(const RadixNode& node, double now_s, Access access) override {
    Observe(now_s);
    // The lives eviction decides about are those of candidates (leaves of a pool); inner
    // nodes are matched far more often and would drown them.
    if (access != Access::kMatch || node.hits == 0 || !IsCandidate(node)) return;
    Stats(ClassOf(node.tree->group(), node.hits)).reused[AgeBucket(now_s - node.last_access_s)] +=
        node.size();
    Event();
  }

  double Score(const RadixNode& node) const override {
    if (node.replicas.size() > 1) return kReplicated + node.last_access_s;
    const uint32_t c = ClassOf(node.tree->group(), node.hits);
    worth_[c / kReuseClasses] = WorthPerByte(node);
    return c * kClassSpan + node.last_access_s;
  }

 private:
  // Decayed counts of page lives of one class that ended, by age bucket: reused (a hit, or
  // a ghost hit) or evicted without reuse. Counted in pages, so that a node evicted a few
  // tail pages at a time counts as much as one evicted whole.
  struct ClassStats {
    double reused[kAgeBuckets] = {};
    double ended[kAgeBuckets] = {};
  };
  // One (class, age bucket) cell of the ranking.
  struct Rank {
    double density;  // expected hits per second of residence, times worth per byte
    uint32_t cls;
    int bucket;
  };

  uint32_t ClassOf(uint32_t group, uint32_t hits) const {
    auto [it, added] = group_slot_.try_emplace(group, 0);
    if (added) {
      it->second =
          std::min<uint32_t>(static_cast<uint32_t>(group_slot_.size()) - 1, kMaxGroups - 1);
    }
    return it->second * kReuseClasses + ReuseClass(hits, params_.reuse_classes);
  }
  ClassStats& Stats(uint32_t cls) {
    if (cls >= stats_.size()) stats_.resize(cls + 1);
    return stats_[cls];
  }
  void Observe(double now_s) { now_s_ = std::max(now_s_, now_s); }
  void Event() {
    if (++events_ % kRankEvery == 0) Rerank();
  }
  void Rerank();
  RadixNode* LruVictim(const absl::btree_set<Key>& set) const;
  // Null before the first ranking, or when no ranked cell holds a candidate.
  RadixNode* DensityVictim(const absl::btree_set<Key>& set) const;
  // Whether the density expert's victims come back (ghost hits, per evicted page) no more
  // often than the LRU expert's.
  bool DensityLeads() const {
    const double d = expert_regretted_[0] / std::max(1.0, expert_evicted_[0]);
    const double l = expert_regretted_[1] / std::max(1.0, expert_evicted_[1]);
    return d <= l;
  }

  const DensityParams params_;
  mutable absl::flat_hash_map<uint32_t, uint32_t> group_slot_;
  mutable double worth_[kMaxGroups] = {};
  std::vector<ClassStats> stats_;
  std::vector<Rank> ranking_;  // lowest density first
  uint64_t events_ = 0;
  // Pages evicted by, and pages of those asked for again within the regret window, per
  // expert (density, lru); decayed with the counts.
  double expert_evicted_[2] = {}, expert_regretted_[2] = {};
  mutable uint8_t last_choice_ = kNoExpert;
  double now_s_ = -std::numeric_limits<double>::infinity();
};

void HitDensityPolicy::Rerank() {
  ranking_.clear();
  for (uint32_t c = 0; c < stats_.size(); ++c) {
    ClassStats& s = stats_[c];
    // A candidate of age bucket b lives on to a reuse or an end in bucket j >= b: hit
    // density = reuses to come / expected residence to come (LHD's measure).
    double hits = 0, lives = 0, residence = 0;
    const double worth = worth_[c / kReuseClasses] > 0 ? worth_[c / kReuseClasses] : 1;
    for (int b = kAgeBuckets - 1; b >= 0; --b) {
      hits += s.reused[b];
      lives += s.reused[b] + s.ended[b];
      // sum over j >= b of lives_j * (mid_j - low_b) = sum lives_j * mid_j - lives * low_b
      residence += (s.reused[b] + s.ended[b]) * BucketMid(b);
      const double left = residence - lives * BucketLow(b);
      ranking_.push_back({.density = left > 0 ? worth * hits / left : 0, .cls = c, .bucket = b});
    }
    for (int b = 0; b < kAgeBuckets; ++b) {
      s.reused[b] *= kDecay;
      s.ended[b] *= kDecay;
    }
  }
  for (int e = 0; e < 2; ++e) {
    expert_evicted_[e] *= kDecay;
    expert_regretted_[e] *= kDecay;
  }
  // Lowest density first; among equals the older bucket, so that with nothing learnt yet
  // the order is least recently used first.
  std::sort(ranking_.begin(), ranking_.end(), [](const Rank& a, const Rank& b) {
    if (a.density != b.density) return a.density < b.density;
    if (a.bucket != b.bucket) return a.bucket > b.bucket;
    return a.cls < b.cls;
  });
}

std::optional<EvictionCandidate> HitDensityPolicy::Victim(PoolId pool) const {
  last_choice_ = kNoExpert;
  const absl::btree_set<Key>* set = CandidatesOf(pool);
  if (set == nullptr) return std::nullopt;
  const Key& first = *set->begin();
  if (std::get<0>(first) < kReplicated / 2) return EvictionCandidate{std::get<2>(first), pool};
  RadixNode* const lru = LruVictim(*set);
  RadixNode* const density = DensityVictim(*set);
  if (density == nullptr || density == lru) {
    last_choice_ = kDensityExpert | kLruExpert;
    return EvictionCandidate{lru, pool};
  }
  // The experts disagree: the one whose victims came back less often decides.
  const bool use_density = !params_.lru_guard || DensityLeads();
  last_choice_ = use_density ? kDensityExpert : kLruExpert;
  return EvictionCandidate{use_density ? density : lru, pool};
}

RadixNode* HitDensityPolicy::LruVictim(const absl::btree_set<Key>& set) const {
  // The least recently used head of any class.
  RadixNode* oldest = nullptr;
  double oldest_s = std::numeric_limits<double>::infinity();
  const uint32_t classes = static_cast<uint32_t>(group_slot_.size()) * kReuseClasses;
  for (uint32_t c = 0; c < classes; ++c) {
    auto it = set.lower_bound(Key{c * kClassSpan - kClassSpan / 2, 0, nullptr});
    if (it == set.end()) break;
    if (std::get<0>(*it) >= c * kClassSpan + kClassSpan / 2) continue;
    const double at = std::get<0>(*it) - c * kClassSpan;
    if (at < oldest_s) {
      oldest_s = at;
      oldest = std::get<2>(*it);
    }
  }
  return oldest != nullptr ? oldest : std::get<2>(*set.begin());
}

RadixNode* HitDensityPolicy::DensityVictim(const absl::btree_set<Key>& set) const {
  if (ranking_.empty()) return nullptr;
  // The age buckets each class spans in this pool, from its oldest and youngest candidate.
  constexpr int kAbsent = -1;
  thread_local std::vector<std::pair<int, int>> span;  // (youngest, oldest) bucket
  span.assign(stats_.size(), {kAbsent, kAbsent});
  for (uint32_t c = 0; c < stats_.size(); ++c) {
    auto lo = set.lower_bound(Key{c * kClassSpan - kClassSpan / 2, 0, nullptr});
    auto hi = set.lower_bound(Key{c * kClassSpan + kClassSpan / 2, 0, nullptr});
    if (lo == hi) continue;
    const double oldest = std::get<0>(*lo) - c * kClassSpan;
    const double youngest = std::get<0>(*std::prev(hi)) - c * kClassSpan;
    span[c] = {AgeBucket(now_s_ - youngest), AgeBucket(now_s_ - oldest)};
  }
  for (const Rank& r : ranking_) {
    const auto [young, old] = span[r.cls];
    if (young == kAbsent || r.bucket < young || r.bucket > old) continue;
    // Candidates of the class whose age falls in the bucket: last access in
    // (now - high, now - low].
    const double base = r.cls * kClassSpan + now_s_;
    auto it = set.lower_bound(Key{
        std::max(base - BucketHigh(r.bucket), r.cls * kClassSpan - kClassSpan / 2), 0, nullptr});
    if (it != set.end() && std::get<0>(*it) <= base - BucketLow(r.bucket)) {
      return std::get<2>(*it);
    }
  }
  return nullptr;
}

}  // namespace

std::unique_ptr<EvictionPolicy> MakeHitDensityPolicy(const DensityParams& params) {
  return std::make_unique<HitDensityPolicy>(params);
}

}  // namespace kvcm
