// "select": evicts in the order of one of several candidate policies, chosen online by
// miniature simulations; the manager's default.
//
// No fixed scoring rule won everywhere (docs/EVICTION.md): each of lru, cost, adaptive,
// density and conversation lost to lru somewhere. So select runs every candidate of the
// policy table (PolicyEntry::candidate) twice:
//
//   - live, over the index itself: every candidate sees every access, ghost and added leaf,
//     so the learning ones stay warm, but only the chosen one orders the candidates and
//     picks victims;
//   - in miniature, in a CacheIndex of its own with one pool per GPU pool of the index
//     (SHARDS: Waldspurger et al., FAST '15; "Cache Modeling and Optimization using
//     Miniature Simulations", ATC '17): a page is in the sample when a keyed hash of it is
//     below the pool's sample rate, and the miniature pool has the real pool's capacity
//     times that rate. A prompt's sampled pages keep their order, and page hashes are
//     chained, so the miniature tree is the real one with the unsampled pages left out.
//     A counting Match by the agent of a GPU pool looks the sampled pages up in every
//     miniature pool of that pool (the hit is the leading sampled pages it holds) and
//     stores them there, as the request will in the real pool; an Insert stores them too
//     (for workers whose Match names no agent).
//
// Each pool's rate is the largest power of two (at most 1) that keeps its miniature pool
// within SelectParams::shadow_pages pages: small pools are simulated exactly, large ones by
// a sample of a few thousand pages, which SHARDS found enough for a miss-ratio curve.
//
// The choice: each candidate's miniature hit pages and the looked-up pages are counted,
// weighted by the inverse sample rate and decayed with a half-life of window_capacities
// times the pools' capacity in pages. It starts on SelectParams::initial; once
// dwell_capacities times the pools' capacity of pages have been looked up since the start
// or the last move, the choice moves to the candidate with the highest windowed hit rate
// if it beats the current one by more than margin_points. The guarantee is by
// construction: from then on, the chosen candidate's miniature hit rate is within
// margin_points of the best candidate's over the window, lru's included, except for at
// most one dwell after each move. What it does not promise: that the real index, whose
// contents the previous choice shaped, realises the miniature figures at once (a learning
// candidate classes pages by what happened to them, so what another one evicted can cost
// it for as long as those pages live); and for sampled (large) pools, the sample's error.
// docs/EVICTION.md ("Selection by miniature simulation") has both measured.
//
// A move re-scores every candidate of the index under the new choice (O(n log n), under the
// index's exclusive lock, at most once per dwell; docs/PERFORMANCE.md has its cost).
//
// Whatever the choice, select demotes a GPU victim to its agent's HOST pool when there is
// one (the miniature caches have no HOST tier: they rank the candidates' GPU hits). A pool
// that is dropped (OnPoolRetired) leaves the miniature indexes with its pages.
//
// Thread-safety: as every policy, called under the index's lock, except OnPrompt, which may
// run under the shared lock on several threads and takes the policy's own mutex.
#ifndef KVCM_SERVER_CORE_POLICIES_SELECT_H_
#define KVCM_SERVER_CORE_POLICIES_SELECT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/eviction_policy.h"

namespace kvcm {

class CacheIndex;

class SelectingPolicy final : public EvictionPolicy {
 public:
  // Every candidate of the policy table, made over `context`; INVALID_ARGUMENT naming the
  // SelectParams field for a bad one, or a candidate's own error.
  static absl::StatusOr<std::unique_ptr<SelectingPolicy>> Create(const PolicyContext& context);
  ~SelectingPolicy() override;

  absl::string_view name() const override { return "select"; }
  bool trims_nodes() const override { return active().trims_nodes(); }
  // Whatever the choice, a GPU victim moves to its agent's HOST pool when there is one:
  // which page goes is the candidates' question, keeping a copy costs nothing of theirs.
  bool demotes_to_host() const override { return true; }

  void Add(RadixNode* node, PoolId pool) override;
  void Remove(RadixNode* node, PoolId pool) override { active().Remove(node, pool); }
  void TrackGroups() override;
  void Touch(RadixNode* node, uint64_t stamp, double now_s, Access access) override;
  void Rescore(RadixNode* node) override {
    active().Rescore(node);
    node->score_epoch = epoch_;
  }
  std::optional<EvictionCandidate> Victim(PoolId pool) const override {
    return active().Victim(pool);
  }
  std::optional<EvictionCandidate> GroupVictim(uint32_t group) const override {
    return active().GroupVictim(group);
  }
  double Priority(const RadixNode* node, PoolId pool) const override {
    return node->score_epoch == epoch_ ? active().Priority(node, pool) : active().Score(*node);
  }

  // Each candidate's tag in its own byte (at most kMaxCandidates).
  uint64_t OnGhostAdded(const RadixNode& node, double now_s) override;
  void OnGhostHit(const RadixNode& leaf, const GhostHit& ghost, double now_s) override;
  void OnLeafAdded(RadixNode& leaf, const GhostHit* ghost, double now_s) override;

  bool observes_prompts() const override { return true; }
  void OnPrompt(const PromptEvent& prompt) override ABSL_LOCKS_EXCLUDED(mu_);
  void Settle() override ABSL_LOCKS_EXCLUDED(mu_);
  void OnPoolRetired(PoolId pool) override ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<SelectionStats> selection() const override ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr size_t kMaxCandidates = 8;

 protected:
  double Score(const RadixNode& node) const override { return active().Score(node); }

 private:
  struct Candidate {
    std::string name;
    std::unique_ptr<EvictionPolicy> live;  // over the index
    std::unique_ptr<CacheIndex> shadow;    // its miniature caches
    double hits = 0;                       // decayed, in estimated pages of the index
  };
  // A GPU pool of the index, as its miniature pools see it.
  struct ShadowPool {
    PoolKey key;                  // in every shadow
    uint32_t shift = 0;           // sample rate 2^-shift
    uint64_t capacity_bytes = 0;  // of the index's pool
    uint64_t capacity_pages = 0;
  };

  SelectingPolicy(const PolicyContext& context, std::vector<Candidate> candidates, size_t initial);

  EvictionPolicy& active() const {
    return *candidates_[active_.load(std::memory_order_relaxed)].live;
  }
  // The miniature pool of `prompt.pool`, made or resized for its capacity now.
  ShadowPool& PoolFor(const PromptEvent& prompt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Sampled(const PageHash& page, uint32_t shift) const;
  // Decays the counts over `pages` looked-up pages of the index and moves the choice when
  // a half-life has passed since the last move.
  void Decide(double pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SelectParams params_;
  const uint64_t sample_key_;  // per process: no client can aim pages at the sample
  // Fixed at construction; each shadow and the hits are guarded by mu_, each live policy by
  // the index's lock.
  std::vector<Candidate> candidates_;
  // Changed by Settle only (the index's exclusive lock); read under the index's lock, and
  // by selection() without it.
  std::atomic<size_t> active_;
  uint16_t epoch_ = 0;           // moves so far (wrapping): RadixNode::score_epoch of a fresh score
  std::atomic<size_t> pending_;  // what Decide chose; Settle applies it

  mutable absl::Mutex mu_;
  absl::flat_hash_map<PoolId, ShadowPool> pools_ ABSL_GUARDED_BY(mu_);
  uint64_t total_capacity_pages_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t pool_generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<NamespaceId> namespaces_ ABSL_GUARDED_BY(mu_);
  double lookups_ ABSL_GUARDED_BY(mu_) = 0;  // decayed, estimated pages of the index
  double since_move_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> switches_{0};  // moves Settle applied
  uint64_t sampled_lookup_pages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sampled_store_pages_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_POLICIES_SELECT_H_
