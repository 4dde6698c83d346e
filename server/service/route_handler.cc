#include "server/service/route_handler.h"

#include <algorithm>
#include <span>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/transports.h"

namespace kvcm {

RouteHandler::RouteHandler(CacheIndex* index, const AgentRegistry* agents,
                           const EngineSessions* engines, RequestLimits limits,
                           RouteDefaults defaults)
    : index_(index), agents_(agents), engines_(engines), limits_(limits), defaults_(defaults) {}

absl::StatusOr<std::vector<RouteCandidate>> RouteHandler::Candidates(
    std::span<const RouteCall::Candidate> named, absl::string_view tenant) const {
  std::vector<AgentInfo> agents =
      agents_ != nullptr ? agents_->Snapshot() : std::vector<AgentInfo>{};
  absl::flat_hash_map<absl::string_view, const AgentInfo*> by_id;
  for (const AgentInfo& a : agents) {
    if (a.alive) by_id.emplace(a.registration.agent_id, &a);
  }
  std::vector<EngineSessionInfo> engines =
      engines_ != nullptr ? engines_->Snapshot() : std::vector<EngineSessionInfo>{};
  std::erase_if(engines, [&](const EngineSessionInfo& e) { return e.ns.tenant != tenant; });
  absl::flat_hash_set<absl::string_view> engine_ids;
  for (const EngineSessionInfo& e : engines) engine_ids.insert(e.engine_id);
  auto candidate = [&](const AgentInfo& a) {
    const double measured = a.usage.pull_gbps;
    return RouteCandidate{
        .agent_id = a.registration.agent_id,
        .link_gbps = measured > 0 ? measured : UnmeasuredLinkGbps(a.registration.transport)};
  };
  std::vector<RouteCandidate> out;
  if (named.empty()) {
    for (const AgentInfo& a : agents) {
      if (a.alive) out.push_back(candidate(a));
    }
    for (const EngineSessionInfo& e : engines) {
      out.push_back(RouteCandidate{.agent_id = e.engine_id});
    }
    if (out.empty()) return absl::FailedPreconditionError("no live agent or engine to route to");
    std::sort(out.begin(), out.end(), [](const RouteCandidate& a, const RouteCandidate& b) {
      return a.agent_id < b.agent_id;
    });
    return out;
  }
  for (size_t i = 0; i < named.size(); ++i) {
    auto it = by_id.find(named[i].agent_id);
    RouteCandidate c;
    if (it != by_id.end()) {
      c = candidate(*it->second);
    } else if (engine_ids.contains(named[i].agent_id)) {
      c.agent_id = named[i].agent_id;  // link_gbps 0: an engine saves what it holds
    } else {
      return absl::NotFoundError(absl::StrCat("candidates[", i, "].agent_id \"", named[i].agent_id,
                                              "\" is not a live agent or engine"));
    }
    c.load = named[i].load;
    c.queued_prefill_tokens = named[i].queued_prefill_tokens;
    out.push_back(std::move(c));
  }
  return out;
}

double RouteHandler::UnmeasuredLinkGbps(absl::string_view transport) const {
  if (transport.empty()) transport = kDefaultTransport;
  if (auto it = defaults_.link_gbps.find(transport); it != defaults_.link_gbps.end()) {
    return it->second;
  }
  return DefaultLinkGbps(transport);
}

absl::Status RouteHandler::Route(const v1::RouteRequest& req, v1::RouteResponse* resp) {
  KVCM_ASSIGN_OR_RETURN(RouteCall call, RouteFromProto(*index_, req, limits_));
  KVCM_ASSIGN_OR_RETURN(std::vector<RouteCandidate> candidates,
                        Candidates(call.candidates, call.ns.tenant));
  KVCM_ASSIGN_OR_RETURN(RegisterModelResult ns, index_->GetNamespace(call.ns));
  const RouteCost cost{.bytes_per_page = ns.spec.BytesPerPage(),
                       .page_size_tokens = ns.spec.page_size_tokens,
                       .prefill_tokens_per_s = call.prefill_tokens_per_s > 0
                                                   ? call.prefill_tokens_per_s
                                                   : defaults_.prefill_tokens_per_s};
  const std::vector<PageHash>& pages = call.prompt.pages;
  // One look at every replica ranks every candidate; it changes nothing.
  KVCM_ASSIGN_OR_RETURN(MatchResult match, index_->Match(call.ns, pages, {.probe = true}));
  const uint64_t sequence = call.probe ? sequence_.load(std::memory_order_relaxed)
                                       : sequence_.fetch_add(1, std::memory_order_relaxed);
  std::vector<RouteEstimate> ranked = RankAgents(call.policy, match, candidates, cost, sequence,
                                                 pages.empty() ? nullptr : &pages[0]);
  RouteEstimate& best = ranked.front();
  const RouteCandidate& chosen = candidates[best.candidate];
  if (call.probe) {
    // The probe's replicas in the chosen agent's order, as Match would list them for it.
    for (const MatchedSegment& seg : match.segments) {
      const std::span<MatchedReplica> replicas = match.Replicas(seg);
      std::stable_partition(replicas.begin(), replicas.end(), [&](const MatchedReplica& r) {
        return r.pool->agent_id == chosen.agent_id;
      });
    }
    match.local_pages = best.cached_pages;
  } else {
    // What a Match from the chosen agent does: recency, counters and the pin. The index
    // may have changed since the probe, so the chosen agent's estimate is redone on it.
    KVCM_ASSIGN_OR_RETURN(match, index_->Match(call.ns, pages,
                                               {.requester_agent_id = chosen.agent_id,
                                                .pin = call.pin,
                                                .lease_ttl = call.lease_ttl}));
    best = EstimateFor(match, best.candidate, chosen, cost);
  }
  for (const RouteEstimate& e : ranked) {
    RouteEstimateToProto(e, candidates[e.candidate], resp->add_ranked());
  }
  MatchResultToProto(match, call.prompt.page_size_tokens, resp->mutable_match());
  return absl::OkStatus();
}

}  // namespace kvcm
