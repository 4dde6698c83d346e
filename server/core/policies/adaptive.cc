// "adaptive": the cost score with a reuse credit learnt online (AdaptivePolicy,
// eviction_policy.h).
#include <algorithm>

#include "server/core/eviction_policy.h"
#include "server/core/policies/policy_internal.h"

namespace kvcm {
namespace {

using policy_internal::CountedReuses;
using policy_internal::CreditedScore;
using policy_internal::IsCandidate;

// Decay of the adaptive policy's counts per event: they cover about the last 1,024 events,
// a count, not a time.
constexpr double kCountDecay = 1.0 - 1.0 / 1024;

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

uint64_t AdaptivePolicy::OnGhostAdded(const RadixNode& node, double now_s) {
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

}  // namespace kvcm
