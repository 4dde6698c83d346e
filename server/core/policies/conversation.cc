// "conversation": eviction by how likely a context's conversation is to come back, learnt
// online. See eviction_policy.h and docs/EVICTION.md ("Conversation turns").
#include <algorithm>
#include <array>
#include <cmath>
#include <memory>

#include "server/core/eviction_policy.h"
#include "server/core/policies/policy_internal.h"

namespace kvcm {
namespace {

// A node another pool also holds goes first, as in "cost".
using policy_internal::kReplicatedFirst;
using policy_internal::WorthPerByte;

// Classes: turn depth 0, 1, 2, 3, 4+ times pages added in power-of-two buckets 1, 2-3, 4-7,
// ..., 128+.
constexpr uint32_t kTurnBuckets = 5;
constexpr uint32_t kPageBuckets = 8;
constexpr uint32_t kClasses = kTurnBuckets * kPageBuckets;

// Counts cover about the last 2,048 leaves added: a count, not a time.
constexpr double kDecay = 1.0 - 1.0 / 2048;
// Leaves' worth of the overall rate a class starts from (and is pulled towards while it
// has few of its own).
constexpr double kPrior = 8;
// Continuation rates are kept inside [1 %, 99 %] so that a log-odds stays finite.
constexpr double kMinRate = 0.01;
// The typical gap is a running mean of log-gaps over about the last 256 continuations.
constexpr double kGapWindow = 256;

uint8_t ClassOf(uint32_t turn, uint32_t added_pages) {
  const uint32_t t = std::min(turn, kTurnBuckets - 1);
  const uint32_t p =
      std::min<uint32_t>(std::bit_width(std::max(added_pages, 1u)) - 1, kPageBuckets - 1);
  return static_cast<uint8_t>(t * kPageBuckets + p);
}

uint32_t TurnOfClass(uint8_t cls) { return cls / kPageBuckets; }

class ConversationPolicy final : public EvictionPolicy {
 public:
  explicit ConversationPolicy(const ConversationParams& params) : params_(params) {
    RecomputeLogOdds();
  }

  absl::string_view name() const override { return "conversation"; }
  bool trims_nodes() const override { return true; }
  bool demotes_to_host() const override { return true; }

  void OnLeafAdded(RadixNode& leaf, const GhostHit* ghost, double /*now_s*/) override {
    uint32_t turn = 0;
    uint32_t added = leaf.size();
    if (ghost != nullptr && ghost->tag > 0) {
      // An evicted leaf asked for again: the same turn when it came back as it was, the next
      // one when the prompt goes on past it.
      turn = TurnOfClass(ghost->tag - 1);
      if (leaf.size() > ghost->pages) {
        ++turn;
        added = leaf.size() - ghost->pages;
      }
    } else if (!leaf.parent->is_root() && leaf.parent->children.size() == 1) {
      // The prompt extends a whole leaf: the next turn of its conversation.
      turn = leaf.parent->turn + 1u;
    }
    leaf.turn = static_cast<uint8_t>(std::min<uint32_t>(turn, 255));
    leaf.policy_class = ClassOf(turn, added);
    for (Rate& r : rates_) {
      r.added *= kDecay;
      r.continued *= kDecay;
    }
    total_added_ = total_added_ * kDecay + 1;
    total_continued_ *= kDecay;
    rates_[leaf.policy_class].added += 1;
    RecomputeLogOdds();
  }

  uint64_t OnGhostAdded(const RadixNode& node, double /*now_s*/) override {
    return static_cast<uint8_t>(node.policy_class + 1);
  }

  void OnGhostHit(const RadixNode& /*leaf*/, const GhostHit& ghost, double now_s) override {
    if (ghost.tag == 0) return;
    Continued(ghost.tag - 1, now_s - ghost.last_access_s);
  }

  // The typical time to a continuation (seconds; 0 before the first) and a class's learnt
  // log-odds of continuing, for tests.
  double typical_gap_s() const { return gap_samples_ > 0 ? std::exp(mean_log_gap_) : 0; }
  double log_odds(uint8_t cls) const { return log_odds_[cls]; }

 protected:
  void OnTouch(const RadixNode& node, double now_s, Access access) override {
    // A match that covers a whole leaf: the leaf's conversation came back.
    if (access == Access::kMatch && node.hits > 0 && node.children.empty() && !node.is_root()) {
      Continued(node.policy_class, now_s - node.last_access_s);
    }
  }

  double Score(const RadixNode& node) const override {
    if (node.replicas.size() > 1) return node.last_access_s - kReplicatedFirst;
    if (gap_samples_ == 0 || params_.shift == 0) return node.last_access_s;
    const double value = log_odds_[node.policy_class] + std::log(WorthPerByte(node));
    return node.last_access_s + params_.shift * typical_gap_s() * value;
  }

 private:
  struct Rate {
    double added = 0;      // leaves of the class added (decayed)
    double continued = 0;  // of those, continued (decayed)
  };

  void Continued(uint8_t cls, double gap_s) {
    if (cls >= kClasses) return;
    rates_[cls].continued += 1;
    total_continued_ += 1;
    ++gap_samples_;
    mean_log_gap_ += (std::log(std::max(gap_s, 1e-3)) - mean_log_gap_) /
                     std::min<double>(static_cast<double>(gap_samples_), kGapWindow);
    RecomputeLogOdds();
  }

  void RecomputeLogOdds() {
    const double overall = total_added_ > 0
                               ? std::clamp(total_continued_ / total_added_, kMinRate, 1 - kMinRate)
                               : 0.5;
    for (uint32_t c = 0; c < kClasses; ++c) {
      const Rate& r = rates_[c];
      const double p =
          std::clamp((r.continued + kPrior * overall) / (r.added + kPrior), kMinRate, 1 - kMinRate);
      log_odds_[c] = std::log(p / (1 - p));
    }
  }

  const ConversationParams params_;
  std::array<Rate, kClasses> rates_{};
  double total_added_ = 0, total_continued_ = 0;
  std::array<double, kClasses> log_odds_{};
  double mean_log_gap_ = 0;
  uint64_t gap_samples_ = 0;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeConversationPolicy(const ConversationParams& params) {
  return std::make_unique<ConversationPolicy>(params);
}

}  // namespace kvcm
