#include "server/core/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

constexpr RoutePolicy kPolicies[] = {RoutePolicy::kPrefillSaved, RoutePolicy::kRoundRobin,
                                     RoutePolicy::kFirstPageHash, RoutePolicy::kLeastLoaded};

bool PositiveFinite(double x) { return std::isfinite(x) && x > 0; }

// Candidates in order from `start`, wrapping around.
std::vector<size_t> Rotated(size_t n, size_t start) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = (start + i) % n;
  return order;
}

}  // namespace

absl::string_view RoutePolicyName(RoutePolicy policy) {
  switch (policy) {
    case RoutePolicy::kPrefillSaved:
      return "prefill-saved";
    case RoutePolicy::kRoundRobin:
      return "round-robin";
    case RoutePolicy::kFirstPageHash:
      return "hash-of-first-page";
    case RoutePolicy::kLeastLoaded:
      return "least-loaded";
  }
  return "unknown";
}

absl::StatusOr<RoutePolicy> ParseRoutePolicy(absl::string_view name) {
  for (RoutePolicy p : kPolicies) {
    if (name == RoutePolicyName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("route policy \"", name,
                   "\" is unknown; known: prefill-saved, round-robin, hash-of-first-page, "
                   "least-loaded"));
}

absl::Status RouteCost::Validate() const {
  if (bytes_per_page == 0) return absl::InvalidArgumentError("bytes_per_page must be > 0");
  if (page_size_tokens == 0) return absl::InvalidArgumentError("page_size_tokens must be > 0");
  if (!PositiveFinite(prefill_tokens_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill_tokens_per_s must be positive and finite, got ", prefill_tokens_per_s));
  }
  return absl::OkStatus();
}

RouteEstimate EstimateFor(const MatchResult& match, size_t index, const RouteCandidate& candidate,
                          const RouteCost& cost) {
  RouteEstimate e{.candidate = index};
  // Pages of one pool are prefix-closed, so the agent's pages are the leading segments
  // that list one of its pools.
  for (const MatchedSegment& seg : match.segments) {
    const bool held = std::ranges::any_of(match.Replicas(seg), [&](const MatchedReplica& r) {
      return r.pool->agent_id == candidate.agent_id;
    });
    if (!held) break;
    e.cached_pages += seg.num_pages;
  }
  const double ms_per_page = 1e3 * cost.page_size_tokens / cost.prefill_tokens_per_s;
  const uint32_t remote = match.matched_pages - e.cached_pages;
  if (remote > 0 && candidate.link_gbps > 0) {
    const double transfer_ms =
        1e3 * static_cast<double>(remote) * cost.bytes_per_page * 8 / (candidate.link_gbps * 1e9);
    if (transfer_ms < remote * ms_per_page) {
      e.fetch_pages = remote;
      e.transfer_ms = transfer_ms;
    }
  }
  e.recompute_pages = match.prompt_pages - e.cached_pages - e.fetch_pages;
  e.saved_prefill_ms = (e.cached_pages + e.fetch_pages) * ms_per_page - e.transfer_ms;
  e.queue_ms =
      1e3 * static_cast<double>(candidate.queued_prefill_tokens) / cost.prefill_tokens_per_s;
  return e;
}

std::vector<RouteEstimate> RankAgents(RoutePolicy policy, const MatchResult& match,
                                      std::span<const RouteCandidate> candidates,
                                      const RouteCost& cost, uint64_t sequence,
                                      const PageHash* first_page) {
  const size_t n = candidates.size();
  std::vector<size_t> order;
  switch (policy) {
    case RoutePolicy::kRoundRobin:
      order = Rotated(n, n == 0 ? 0 : sequence % n);
      break;
    case RoutePolicy::kFirstPageHash:
      order = Rotated(n, n == 0 || first_page == nullptr ? 0 : first_page->lo % n);
      break;
    case RoutePolicy::kPrefillSaved:
    case RoutePolicy::kLeastLoaded:
      order.resize(n);
      std::iota(order.begin(), order.end(), 0);
      break;
  }
  std::vector<RouteEstimate> ranked;
  ranked.reserve(n);
  for (size_t i : order) ranked.push_back(EstimateFor(match, i, candidates[i], cost));
  auto load = [&](const RouteEstimate& e) { return candidates[e.candidate].load; };
  if (policy == RoutePolicy::kPrefillSaved) {
    std::stable_sort(ranked.begin(), ranked.end(),
                     [&](const RouteEstimate& a, const RouteEstimate& b) {
                       if (a.score_ms() != b.score_ms()) return a.score_ms() > b.score_ms();
                       return load(a) < load(b);
                     });
  } else if (policy == RoutePolicy::kLeastLoaded) {
    std::stable_sort(
        ranked.begin(), ranked.end(),
        [&](const RouteEstimate& a, const RouteEstimate& b) { return load(a) < load(b); });
  }
  return ranked;
}

}  // namespace kvcm
