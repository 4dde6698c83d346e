// Route: which agent should serve a prompt (ARCHITECTURE §2, "Route / fetch").
//
// For each candidate agent, one match of the prompt says how many leading pages the agent
// holds already and how many of the pages after them other agents hold. Moving those costs
// bytes / link bandwidth; recomputing them costs tokens / prefill throughput; the cheaper
// wins. The expected prefill saved is then
//
//   saved = (cached + fetched pages) x page tokens / prefill rate - transfer time
//
// and the policies order the candidates by it (prefill-saved) or ignore it (round-robin,
// hash-of-first-page, least-loaded, kept as the cache-blind baselines routers use today).
//
// These are pure functions over a MatchResult, so the manager's Route RPC and kvcm-bench's
// replay rank with the same code and cannot drift.
#ifndef KVCM_SERVER_CORE_ROUTER_H_
#define KVCM_SERVER_CORE_ROUTER_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/page_hash.h"
#include "server/core/cache_index.h"

namespace kvcm {

// Values match kvcm.v1.RoutePolicy.
enum class RoutePolicy : uint8_t {
  kPrefillSaved = 1,   // highest score_ms first; ties: lower load, then earlier candidate
  kRoundRobin = 2,     // candidate (sequence mod n) first, then the ones after it
  kFirstPageHash = 3,  // candidate (first page hash mod n) first; candidate 0 without pages
  kLeastLoaded = 4,    // lowest load first; ties: earlier candidate
};

// "prefill-saved", "round-robin", "hash-of-first-page", "least-loaded".
absl::string_view RoutePolicyName(RoutePolicy policy);
// INVALID_ARGUMENT listing the known names otherwise.
absl::StatusOr<RoutePolicy> ParseRoutePolicy(absl::string_view name);

struct RouteCandidate {
  std::string agent_id;
  // The caller's load measure (any unit, the same for every candidate).
  uint64_t load = 0;
  // Bandwidth of moving pages to this agent, Gbit/s; 0: it cannot fetch (an engine, whose
  // KV only its own prefill fills), so it saves only what it holds.
  double link_gbps = 0;
  // Prefill tokens waiting for or in prefill on the agent: prefill-saved charges the wait
  // (tokens / prefill rate) against what the agent saves, so a hot prefix does not pull
  // every request onto one agent.
  uint64_t queued_prefill_tokens = 0;
};

// What a page costs to move and to recompute in the prompt's namespace.
struct RouteCost {
  uint64_t bytes_per_page = 0;
  uint32_t page_size_tokens = 0;
  // Prefill throughput of the namespace's model on one GPU, tokens/s. > 0.
  double prefill_tokens_per_s = 0;

  // INVALID_ARGUMENT naming the field unless every field is positive and finite.
  absl::Status Validate() const;
};

// What serving the prompt on one candidate is expected to save.
struct RouteEstimate {
  size_t candidate = 0;          // index into the candidates
  uint32_t cached_pages = 0;     // leading matched pages the agent holds (any of its tiers)
  uint32_t fetch_pages = 0;      // pages after those held elsewhere, cheaper to move than redo
  uint32_t recompute_pages = 0;  // prompt pages left to prefill
  double transfer_ms = 0;        // moving fetch_pages
  double saved_prefill_ms = 0;   // prefill of cached + fetched pages, minus transfer_ms
  double queue_ms = 0;           // queued_prefill_tokens / prefill rate
  // What prefill-saved orders by: saved_prefill_ms - queue_ms.
  double score_ms() const { return saved_prefill_ms - queue_ms; }
};

// The estimate for `candidate` (at index `index`) from `match`, which may have been taken
// for any requester: every replica of every matched page is in it.
RouteEstimate EstimateFor(const MatchResult& match, size_t index, const RouteCandidate& candidate,
                          const RouteCost& cost);

// Every candidate's estimate, best first under `policy`. `sequence` is the round-robin step;
// `first_page` the prompt's first page hash (nullptr when the prompt has no whole page).
// REQUIRES: cost.Validate().ok().
std::vector<RouteEstimate> RankAgents(RoutePolicy policy, const MatchResult& match,
                                      std::span<const RouteCandidate> candidates,
                                      const RouteCost& cost, uint64_t sequence,
                                      const PageHash* first_page);

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_ROUTER_H_
