// What the eviction policies' implementations (this folder) share. Not part of the policy
// interface (server/core/eviction_policy.h).
#ifndef KVCM_SERVER_CORE_POLICIES_POLICY_INTERNAL_H_
#define KVCM_SERVER_CORE_POLICIES_POLICY_INTERNAL_H_

#include <algorithm>

#include "server/core/radix_tree.h"

namespace kvcm::policy_internal {

// Recompute cost saved per byte, relative to a DeepSeek-V3 page, clamped to [1/8, 8].
// Prefill cost is taken as the same for every token (weighting it by position, since
// attention grows with the prefix, lost 1-5 points on the Mooncake trace: deep conversation
// tails are not reused more), so it is the inverse of the model's bytes per token, relative
// to DeepSeek-V3's MLA latent in bf16 (70,272 B per token).
inline double WorthPerByte(const RadixNode& node) {
  constexpr double kReferenceBytesPerToken = 70272;
  const double bytes_per_token =
      static_cast<double>(node.tree->bytes_per_page()) / node.tree->page_size_tokens();
  return std::clamp(kReferenceBytesPerToken / bytes_per_token, 0.125, 8.0);
}

// Whether `node` is an eviction candidate of some pool (an unpinned leaf of it).
inline bool IsCandidate(const RadixNode& node) {
  return std::any_of(node.replicas.begin(), node.replicas.end(),
                     [](const Replica& r) { return r.evictable; });
}

// A node another pool also holds goes before every node that is the only copy: losing it
// costs a transfer, not a recompute. Subtracted from such nodes' scores: more seconds than
// any clock in use reads since the Unix epoch (about 1.8e9 now), so those nodes sort first.
inline constexpr double kReplicatedFirst = 1e12;

// Reuses that count for credit: beyond ten add nothing, so that a once-popular node cannot
// stay forever.
inline double CountedReuses(const RadixNode& node) {
  constexpr uint32_t kMaxReuses = 10;
  return std::min<uint32_t>(node.hits > 0 ? node.hits - 1 : 0, kMaxReuses);
}

// The "cost" score with `credit_s` seconds per reuse: replicated nodes first (least
// recently used first among them), then by last access plus the credit of the reuses.
inline double CreditedScore(const RadixNode& node, double credit_s) {
  if (node.replicas.size() > 1) return node.last_access_s - kReplicatedFirst;
  const double reuses = CountedReuses(node);
  if (reuses == 0) return node.last_access_s;
  return node.last_access_s + credit_s * reuses * WorthPerByte(node);
}

}  // namespace kvcm::policy_internal

#endif  // KVCM_SERVER_CORE_POLICIES_POLICY_INTERNAL_H_
