// What the eviction policies' implementations share (eviction_policy.cc,
// hit_density_policy.cc). Not part of the policy interface.
#ifndef KVCM_SERVER_CORE_EVICTION_POLICY_INTERNAL_H_
#define KVCM_SERVER_CORE_EVICTION_POLICY_INTERNAL_H_

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

}  // namespace kvcm::policy_internal

#endif  // KVCM_SERVER_CORE_EVICTION_POLICY_INTERNAL_H_
