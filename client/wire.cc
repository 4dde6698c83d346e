#include "client/wire.h"

#include <string>

namespace kvcm::wire {

NamespaceId FromProto(const v1::Namespace& ns) { return NamespaceId{ns.tenant(), ns.model()}; }

PoolRef FromProto(const v1::PoolRef& pool) {
  return PoolRef{pool.agent_id(), TierFromProto(pool.tier())};
}

ModelSpec FromProto(const v1::ModelSpec& spec) { return ModelSpecFromTrustedProto(spec); }

void SetTokens(std::span<const int32_t> tokens, v1::Prompt* out) {
  out->mutable_tokens()->mutable_ids()->Assign(tokens.begin(), tokens.end());
}

void SetHashes(std::span<const PageHash> pages, uint32_t page_size_tokens, uint64_t key_fingerprint,
               v1::Prompt* out) {
  out->set_page_hashes(EncodePageHashes(pages));
  v1::HashScheme* scheme = out->mutable_scheme();
  scheme->set_version(kPageHashVersion);
  scheme->set_page_size_tokens(page_size_tokens);
  scheme->set_key_fingerprint(key_fingerprint);
}

MatchReply FromProto(const v1::MatchResponse& response) {
  MatchReply out;
  out.matched_pages = response.matched_pages();
  out.matched_tokens = response.matched_tokens();
  out.prompt_pages = response.prompt_pages();
  out.local_pages = response.local_pages();
  out.segments.reserve(response.segments_size());
  for (const v1::MatchedSegment& s : response.segments()) {
    MatchReply::Segment& segment = out.segments.emplace_back();
    segment.first_page = s.first_page();
    segment.num_pages = s.num_pages();
    segment.replicas.reserve(s.replicas_size());
    for (const v1::Replica& r : s.replicas()) {
      segment.replicas.push_back(
          MatchReply::Replica{FromProto(r.pool()), {r.block_ids().begin(), r.block_ids().end()}});
    }
  }
  out.pin_id = response.pin_id();
  if (response.pin_id() != 0) {
    out.lease_expiry = absl::FromUnixMillis(response.lease_expiry_unix_ms());
  }
  return out;
}

RouteReply FromProto(const v1::RouteResponse& response) {
  RouteReply out;
  out.ranked.reserve(response.ranked_size());
  for (const v1::RankedAgent& r : response.ranked()) {
    out.ranked.push_back(RouteReply::Ranked{.agent_id = r.agent_id(),
                                            .cached_pages = r.cached_pages(),
                                            .fetch_pages = r.fetch_pages(),
                                            .recompute_pages = r.recompute_pages(),
                                            .transfer_ms = r.transfer_ms(),
                                            .saved_prefill_ms = r.saved_prefill_ms(),
                                            .link_gbps = r.link_gbps(),
                                            .load = r.load(),
                                            .queue_ms = r.queue_ms()});
  }
  out.match = FromProto(response.match());
  return out;
}

InsertReply FromProto(const v1::InsertResponse& response) {
  InsertReply out;
  out.already_present_pages = response.already_present_pages();
  out.existing_block_ids.assign(response.existing_block_ids().begin(),
                                response.existing_block_ids().end());
  out.new_pages = response.new_pages();
  out.replicated_pages = response.replicated_pages();
  out.evicted_bytes = response.evicted_bytes();
  return out;
}

EvictReply FromProto(const v1::EvictResponse& response) {
  return EvictReply{response.evicted_bytes(), response.evicted_pages()};
}

ManagerStats FromProto(const v1::StatsResponse& response) {
  ManagerStats out;
  for (const v1::PoolStats& p : response.pools()) {
    out.pools.push_back(ManagerStats::Pool{FromProto(p.pool()), p.capacity_bytes(), p.used_bytes(),
                                           p.pinned_bytes(), p.pages(), p.reserved_bytes(),
                                           p.engine()});
  }
  for (const v1::NamespaceStats& n : response.namespaces()) {
    ManagerStats::Namespace& ns = out.namespaces.emplace_back();
    ns.ns = FromProto(n.namespace_());
    ns.spec = FromProto(n.spec());
    ns.bytes_per_token = n.bytes_per_token();
    ns.bytes_per_page = n.bytes_per_page();
    ns.pages = n.pages();
    ns.page_locations = n.page_locations();
    ns.radix_nodes = n.radix_nodes();
    ns.max_page_age_s = n.max_page_age_s();
    ns.expired_pages = n.expired_pages();
  }
  for (const v1::AgentStats& a : response.agents()) {
    out.agents.push_back(ManagerStats::Agent{a.agent_id(), a.device(), TierFromProto(a.tier()),
                                             a.epoch(), a.alive(), a.last_heartbeat_age_ms(),
                                             a.used_bytes(), a.free_blocks(),
                                             a.block_agent_address(), a.data_address()});
  }
  for (const v1::EngineStats& e : response.engines()) {
    out.engines.push_back(ManagerStats::Engine{e.engine_id(), FromProto(e.namespace_()),
                                               e.session(), e.sequence(), e.last_publish_age_ms(),
                                               e.pages()});
  }
  const v1::Counters& c = response.counters();
  out.counters.match_requests = c.match_requests();
  out.counters.requested_pages = c.requested_pages();
  out.counters.matched_pages = c.matched_pages();
  out.counters.requested_tokens = c.requested_tokens();
  out.counters.matched_tokens = c.matched_tokens();
  out.counters.inserted_pages = c.inserted_pages();
  out.counters.evicted_pages = c.evicted_pages();
  out.counters.evicted_bytes = c.evicted_bytes();
  out.counters.eviction_regret_pages = c.eviction_regret_pages();
  out.counters.pins_taken = c.pins_taken();
  out.counters.pins_released = c.pins_released();
  out.counters.lease_expiries = c.lease_expiries();
  out.counters.demoted_pages = c.demoted_pages();
  out.counters.dropped_pages = c.dropped_pages();
  out.counters.expired_pages = c.expired_pages();
  out.active_pins = response.active_pins();
  out.policy = response.policy();
  if (response.has_selection()) {
    const v1::PolicySelection& s = response.selection();
    ManagerStats::Selection& sel = out.selection.emplace();
    sel.active = s.active();
    for (const v1::PolicySelection::Candidate& candidate : s.candidates()) {
      sel.candidates.push_back({candidate.name(), candidate.shadow_hit_rate()});
    }
    sel.switches = s.switches();
    sel.sampled_lookup_pages = s.sampled_lookup_pages();
    sel.sampled_store_pages = s.sampled_store_pages();
    sel.shadow_pages = s.shadow_pages();
    sel.pools = s.pools();
    sel.min_sample_rate = s.min_sample_rate();
  }
  const v1::Limits& l = response.limits();
  out.limits = ManagerStats::Limits{l.max_tokens_per_request(), l.max_pages_per_request(),
                                    l.max_lease_ttl_ms(), l.default_lease_ttl_ms()};
  return out;
}

WatchedEvent FromProto(const v1::CacheEvent& event) {
  WatchedEvent out;
  switch (event.kind()) {
    case v1::CacheEvent::KIND_STORED:
      out.kind = WatchedEvent::Kind::kStored;
      break;
    case v1::CacheEvent::KIND_REMOVED:
      out.kind = WatchedEvent::Kind::kRemoved;
      break;
    case v1::CacheEvent::KIND_CLEARED:
      out.kind = WatchedEvent::Kind::kCleared;
      break;
    default:
      out.kind = WatchedEvent::Kind::kUnspecified;
      break;
  }
  switch (event.reason()) {
    case v1::CacheEvent::REASON_EVICTED:
      out.reason = WatchedEvent::Reason::kEvicted;
      break;
    case v1::CacheEvent::REASON_EXPIRED:
      out.reason = WatchedEvent::Reason::kExpired;
      break;
    default:
      out.reason = WatchedEvent::Reason::kUnspecified;
      break;
  }
  out.ns = FromProto(event.namespace_());
  out.pool = FromProto(event.pool());
  // A length that is not a multiple of 16 would be a manager bug; keep the whole pages.
  const std::string& bytes = event.page_hashes();
  out.pages = DecodePageHashes(std::string_view(bytes.data(), bytes.size() - bytes.size() % 16));
  out.sequence = event.sequence();
  return out;
}

}  // namespace kvcm::wire
