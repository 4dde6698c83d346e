#include "server/service/proto_convert.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/page_hash.h"
#include "common/status_macros.h"
#include "proto/core_types.h"

namespace kvcm {

// The casts below between the core's enums and kvcm.v1's rely on shared numbering, checked
// here (proto/core_types.h checks Tier, AttentionKind and KvDtype).
static_assert(static_cast<int>(RoutePolicy::kPrefillSaved) == v1::ROUTE_POLICY_PREFILL_SAVED);
static_assert(static_cast<int>(RoutePolicy::kRoundRobin) == v1::ROUTE_POLICY_ROUND_ROBIN);
static_assert(static_cast<int>(RoutePolicy::kFirstPageHash) == v1::ROUTE_POLICY_FIRST_PAGE_HASH);
static_assert(static_cast<int>(RoutePolicy::kLeastLoaded) == v1::ROUTE_POLICY_LEAST_LOADED);
static_assert(v1::RoutePolicy_MAX == v1::ROUTE_POLICY_LEAST_LOADED);
static_assert(static_cast<int>(CacheEvent::Kind::kStored) == v1::CacheEvent::KIND_STORED);
static_assert(static_cast<int>(CacheEvent::Kind::kRemoved) == v1::CacheEvent::KIND_REMOVED);
static_assert(static_cast<int>(CacheEvent::Kind::kCleared) == v1::CacheEvent::KIND_CLEARED);
static_assert(v1::CacheEvent::Kind_MAX == v1::CacheEvent::KIND_CLEARED);
static_assert(static_cast<int>(CacheEvent::Reason::kNone) == v1::CacheEvent::REASON_UNSPECIFIED);
static_assert(static_cast<int>(CacheEvent::Reason::kEvicted) == v1::CacheEvent::REASON_EVICTED);
static_assert(static_cast<int>(CacheEvent::Reason::kExpired) == v1::CacheEvent::REASON_EXPIRED);
static_assert(v1::CacheEvent::Reason_MAX == v1::CacheEvent::REASON_EXPIRED);
namespace {

constexpr size_t kMaxNameBytes = 128;
constexpr size_t kPageHashBytes = 16;

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

std::string Path(absl::string_view parent, absl::string_view child) {
  return absl::StrCat(parent, ".", child);
}

template <typename Message>
const Message* IfSet(bool has, const Message& m) {
  return has ? &m : nullptr;
}

absl::Status ValidateLeaseTtl(uint32_t lease_ttl_ms, absl::string_view field,
                              const RequestLimits& limits) {
  if (lease_ttl_ms > limits.max_lease_ttl_ms) {
    return Invalid(absl::StrCat(field, " ", lease_ttl_ms, " exceeds max_lease_ttl_ms (",
                                limits.max_lease_ttl_ms, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidatePinId(uint64_t pin_id) {
  if (pin_id == 0) return Invalid("pin_id is required (pin ids are never 0)");
  return absl::OkStatus();
}

// Checks of a prompt that need no namespace: presence, emptiness, wire shape, limits.
absl::Status ValidatePromptShape(const v1::Prompt* prompt, const RequestLimits& limits) {
  if (prompt == nullptr) return Invalid("prompt is required");
  switch (prompt->content_case()) {
    case v1::Prompt::kTokens: {
      const int n = prompt->tokens().ids_size();
      if (n == 0) return Invalid("prompt.tokens is empty");
      if (static_cast<uint64_t>(n) > limits.max_tokens_per_request) {
        return Invalid(absl::StrCat("prompt.tokens has ", n, " ids, more than ",
                                    "max_tokens_per_request (", limits.max_tokens_per_request,
                                    ")"));
      }
      return absl::OkStatus();
    }
    case v1::Prompt::kPageHashes: {
      const size_t bytes = prompt->page_hashes().size();
      if (bytes == 0) return Invalid("prompt.page_hashes is empty");
      if (bytes % kPageHashBytes != 0) {
        return Invalid(
            absl::StrCat("prompt.page_hashes length ", bytes, " is not a multiple of 16"));
      }
      if (bytes / kPageHashBytes > limits.max_pages_per_request) {
        return Invalid(absl::StrCat("prompt.page_hashes has ", bytes / kPageHashBytes,
                                    " pages, more than max_pages_per_request (",
                                    limits.max_pages_per_request, ")"));
      }
      if (!prompt->has_scheme()) return Invalid("prompt.scheme is required with page_hashes");
      return absl::OkStatus();
    }
    case v1::Prompt::CONTENT_NOT_SET:
      break;
  }
  return Invalid("prompt is empty: set prompt.tokens or prompt.page_hashes");
}

absl::string_view TierProtoName(int tier) {
  return v1::Tier_IsValid(tier) ? absl::string_view(v1::Tier_Name(tier)) : absl::string_view();
}

}  // namespace

absl::Status ValidateAgentId(absl::string_view agent_id, absl::string_view field) {
  return ValidateName(agent_id, field, "._:-");
}

absl::StatusOr<PoolKey> PoolFromProto(const v1::PoolRef* pool, absl::string_view field) {
  if (pool == nullptr) return Invalid(absl::StrCat(field, " is required"));
  KVCM_RETURN_IF_ERROR(ValidateAgentId(pool->agent_id(), Path(field, "agent_id")));
  PoolKey key{pool->agent_id(), Tier::kGpu};
  switch (pool->tier()) {
    case v1::TIER_GPU:
      key.tier = Tier::kGpu;
      break;
    case v1::TIER_HOST:
      key.tier = Tier::kHost;
      break;
    case v1::TIER_DISK:
      key.tier = Tier::kDisk;
      break;
    default: {
      absl::string_view name = TierProtoName(pool->tier());
      return Invalid(absl::StrCat(
          Path(field, "tier"), " must be TIER_GPU, TIER_HOST or TIER_DISK, got ",
          name.empty() ? "unknown value" : name, " (", static_cast<int>(pool->tier()), ")"));
    }
  }
  return key;
}

namespace {

// The hash scheme of client-computed page hashes against namespace `info`: an unknown
// version or another key is FAILED_PRECONDITION (re-register), another page size
// INVALID_ARGUMENT; `field` names the scheme in the message ("prompt.scheme").
absl::Status CheckScheme(const v1::HashScheme& scheme, const RegisterModelResult& info,
                         absl::string_view field) {
  if (scheme.version() != kPageHashVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ".version ", scheme.version(),
        " is not supported: this manager hashes pages with version ", kPageHashVersion));
  }
  if (scheme.page_size_tokens() != info.spec.page_size_tokens) {
    return Invalid(absl::StrCat(field, ".page_size_tokens ", scheme.page_size_tokens(),
                                " does not match the namespace's page_size_tokens ",
                                info.spec.page_size_tokens));
  }
  if (scheme.key_fingerprint() != KeyFingerprint(info.hash_key)) {
    return absl::FailedPreconditionError(absl::StrCat(
        field,
        ".key_fingerprint is not the namespace's hash key (the manager's secret changed?); "
        "call RegisterModel again to get the current key"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ResolvedPrompt> ResolvePrompt(const CacheIndex& index, const NamespaceId& ns,
                                             const v1::Prompt* prompt,
                                             const RequestLimits& limits) {
  KVCM_RETURN_IF_ERROR(ValidatePromptShape(prompt, limits));
  KVCM_ASSIGN_OR_RETURN(RegisterModelResult info, index.GetNamespace(ns));
  ResolvedPrompt out;
  out.page_size_tokens = info.spec.page_size_tokens;
  if (prompt->has_tokens()) {
    const auto& ids = prompt->tokens().ids();
    const uint64_t pages = static_cast<uint64_t>(ids.size()) / out.page_size_tokens;
    if (pages > limits.max_pages_per_request) {
      return Invalid(absl::StrCat("prompt.tokens spans ", pages, " pages of ", out.page_size_tokens,
                                  " tokens, more than ", "max_pages_per_request (",
                                  limits.max_pages_per_request, ")"));
    }
    KVCM_ASSIGN_OR_RETURN(out.pages,
                          index.HashTokens(ns, std::span<const int32_t>(ids.data(), ids.size())));
    return out;
  }
  KVCM_RETURN_IF_ERROR(CheckScheme(prompt->scheme(), info, "prompt.scheme"));
  out.pages = DecodePageHashes(prompt->page_hashes());
  return out;
}

absl::StatusOr<RegisterModelCall> RegisterModelFromProto(const v1::RegisterModelRequest& req) {
  RegisterModelCall call;
  KVCM_ASSIGN_OR_RETURN(
      call.ns, NamespaceFromProto(IfSet(req.has_namespace_(), req.namespace_()), "namespace"));
  KVCM_ASSIGN_OR_RETURN(call.spec, ModelSpecFromProto(IfSet(req.has_spec(), req.spec())));
  if (req.max_page_age_s() > kMaxPageAgeS) {
    return absl::InvalidArgumentError(absl::StrCat("max_page_age_s must be at most ", kMaxPageAgeS,
                                                   " (10 years; 0: the manager's default), got ",
                                                   req.max_page_age_s()));
  }
  call.max_page_age = absl::Seconds(req.max_page_age_s());
  return call;
}

void RegisterModelResultToProto(const RegisterModelResult& result, v1::RegisterModelResponse* out) {
  ModelSpecToProto(result.spec, out->mutable_spec());
  out->set_bytes_per_token(result.spec.BytesPerToken());
  out->set_bytes_per_page(result.spec.BytesPerPage());
  out->set_hash_key(result.hash_key.ToBytes());
  v1::HashScheme* scheme = out->mutable_scheme();
  scheme->set_version(kPageHashVersion);
  scheme->set_page_size_tokens(result.spec.page_size_tokens);
  scheme->set_key_fingerprint(KeyFingerprint(result.hash_key));
  out->set_created(result.created);
  out->set_max_page_age_s(static_cast<uint32_t>(absl::ToInt64Seconds(result.max_page_age)));
}

absl::StatusOr<MatchCall> MatchFromProto(const CacheIndex& index, const v1::MatchRequest& req,
                                         const RequestLimits& limits) {
  MatchCall call;
  KVCM_ASSIGN_OR_RETURN(
      call.ns, NamespaceFromProto(IfSet(req.has_namespace_(), req.namespace_()), "namespace"));
  if (!req.requester_agent_id().empty()) {
    KVCM_RETURN_IF_ERROR(ValidateAgentId(req.requester_agent_id(), "requester_agent_id"));
  }
  if (req.probe() && req.pin()) {
    return Invalid("probe and pin are mutually exclusive: a probe takes no pin");
  }
  KVCM_RETURN_IF_ERROR(ValidateLeaseTtl(req.lease_ttl_ms(), "lease_ttl_ms", limits));
  KVCM_ASSIGN_OR_RETURN(
      call.prompt, ResolvePrompt(index, call.ns, IfSet(req.has_prompt(), req.prompt()), limits));
  call.options.requester_agent_id = req.requester_agent_id();
  call.options.pin = req.pin();
  call.options.probe = req.probe();
  call.options.lease_ttl = absl::Milliseconds(req.lease_ttl_ms());
  return call;
}

absl::StatusOr<RouteCall> RouteFromProto(const CacheIndex& index, const v1::RouteRequest& req,
                                         const RequestLimits& limits) {
  RouteCall call;
  KVCM_ASSIGN_OR_RETURN(
      call.ns, NamespaceFromProto(IfSet(req.has_namespace_(), req.namespace_()), "namespace"));
  if (req.candidates_size() > kMaxRouteCandidates) {
    return Invalid(
        absl::StrCat("candidates: at most ", kMaxRouteCandidates, ", got ", req.candidates_size()));
  }
  absl::flat_hash_map<absl::string_view, int> seen;
  for (int i = 0; i < req.candidates_size(); ++i) {
    const v1::RouteCandidate& c = req.candidates(i);
    const std::string field = absl::StrCat("candidates[", i, "].agent_id");
    KVCM_RETURN_IF_ERROR(ValidateAgentId(c.agent_id(), field));
    if (auto [it, inserted] = seen.emplace(c.agent_id(), i); !inserted) {
      return Invalid(absl::StrCat(field, " repeats candidates[", it->second, "]"));
    }
    call.candidates.push_back({c.agent_id(), c.load(), c.queued_prefill_tokens()});
  }
  switch (req.policy()) {
    case v1::ROUTE_POLICY_UNSPECIFIED:
    case v1::ROUTE_POLICY_PREFILL_SAVED:
      call.policy = RoutePolicy::kPrefillSaved;
      break;
    case v1::ROUTE_POLICY_ROUND_ROBIN:
    case v1::ROUTE_POLICY_FIRST_PAGE_HASH:
    case v1::ROUTE_POLICY_LEAST_LOADED:
      call.policy = static_cast<RoutePolicy>(req.policy());
      break;
    default:
      return Invalid(absl::StrCat("policy ", static_cast<int>(req.policy()), " is unknown"));
  }
  if (!std::isfinite(req.prefill_tokens_per_s()) || req.prefill_tokens_per_s() < 0) {
    return Invalid(
        absl::StrCat("prefill_tokens_per_s must be 0 (the manager's default) or "
                     "positive and finite, got ",
                     req.prefill_tokens_per_s()));
  }
  call.prefill_tokens_per_s = req.prefill_tokens_per_s();
  if (req.probe() && req.pin()) {
    return Invalid("probe and pin are mutually exclusive: a probe takes no pin");
  }
  KVCM_RETURN_IF_ERROR(ValidateLeaseTtl(req.lease_ttl_ms(), "lease_ttl_ms", limits));
  KVCM_ASSIGN_OR_RETURN(
      call.prompt, ResolvePrompt(index, call.ns, IfSet(req.has_prompt(), req.prompt()), limits));
  call.probe = req.probe();
  call.pin = req.pin();
  call.lease_ttl = absl::Milliseconds(req.lease_ttl_ms());
  return call;
}

void RouteEstimateToProto(const RouteEstimate& estimate, const RouteCandidate& candidate,
                          v1::RankedAgent* out) {
  out->set_agent_id(candidate.agent_id);
  out->set_cached_pages(estimate.cached_pages);
  out->set_fetch_pages(estimate.fetch_pages);
  out->set_recompute_pages(estimate.recompute_pages);
  out->set_transfer_ms(estimate.transfer_ms);
  out->set_saved_prefill_ms(estimate.saved_prefill_ms);
  out->set_link_gbps(candidate.link_gbps);
  out->set_load(candidate.load);
  out->set_queue_ms(estimate.queue_ms);
}

void MatchResultToProto(const MatchResult& result, uint32_t page_size_tokens,
                        v1::MatchResponse* out) {
  out->set_matched_pages(result.matched_pages);
  out->set_matched_tokens(result.matched_pages * page_size_tokens);
  out->set_prompt_pages(result.prompt_pages);
  out->set_local_pages(result.local_pages);
  for (const MatchedSegment& seg : result.segments) {
    v1::MatchedSegment* s = out->add_segments();
    s->set_first_page(seg.first_page);
    s->set_num_pages(seg.num_pages);
    for (const MatchedReplica& rep : result.Replicas(seg)) {
      v1::Replica* r = s->add_replicas();
      PoolToProto(*rep.pool, r->mutable_pool());
      const std::span<const BlockId> ids = result.BlockIds(seg, rep);
      r->mutable_block_ids()->Add(ids.begin(), ids.end());
    }
  }
  out->set_pin_id(result.pin_id);
  out->set_lease_expiry_unix_ms(result.pin_id == 0 ? 0 : absl::ToUnixMillis(result.lease_expiry));
}

absl::StatusOr<InsertCall> InsertFromProto(const CacheIndex& index, const v1::InsertRequest& req,
                                           const RequestLimits& limits) {
  InsertCall call;
  KVCM_ASSIGN_OR_RETURN(
      call.ns, NamespaceFromProto(IfSet(req.has_namespace_(), req.namespace_()), "namespace"));
  KVCM_ASSIGN_OR_RETURN(call.pool, PoolFromProto(IfSet(req.has_pool(), req.pool()), "pool"));
  KVCM_ASSIGN_OR_RETURN(
      call.prompt, ResolvePrompt(index, call.ns, IfSet(req.has_prompt(), req.prompt()), limits));
  if (call.prompt.pages.empty()) {
    return Invalid(absl::StrCat("prompt has no whole page of ", call.prompt.page_size_tokens,
                                " tokens: nothing to insert"));
  }
  if (static_cast<size_t>(req.block_ids_size()) != call.prompt.pages.size()) {
    return Invalid(absl::StrCat("block_ids has ", req.block_ids_size(), " entries, expected ",
                                call.prompt.pages.size(), " (one per whole page)"));
  }
  call.block_ids.assign(req.block_ids().begin(), req.block_ids().end());
  absl::flat_hash_map<BlockId, size_t> first_use;
  first_use.reserve(call.block_ids.size());
  for (size_t i = 0; i < call.block_ids.size(); ++i) {
    if (call.block_ids[i] == kPendingBlock) {
      return Invalid(
          absl::StrCat("block_ids[", i, "] is 0xFFFFFFFF, the value reserved for a pending block"));
    }
    if (auto [it, fresh] = first_use.emplace(call.block_ids[i], i); !fresh) {
      return Invalid(absl::StrCat("block_ids[", i, "] repeats block_ids[", it->second, "] (block ",
                                  call.block_ids[i], "): a block holds one page"));
    }
  }
  call.use_reservation = req.use_reservation();
  call.agent_epoch = req.agent_epoch();
  return call;
}

InsertCommand ToInsertCommand(InsertCall call) {
  return InsertCommand{.ns = std::move(call.ns),
                       .pages = std::move(call.prompt.pages),
                       .pool = std::move(call.pool),
                       .block_ids = std::move(call.block_ids),
                       .use_reservation = call.use_reservation,
                       .agent_epoch = call.agent_epoch};
}

void InsertResultToProto(const InsertResult& result, v1::InsertResponse* out) {
  out->set_already_present_pages(result.already_present_pages);
  out->mutable_existing_block_ids()->Add(result.existing_block_ids.begin(),
                                         result.existing_block_ids.end());
  out->set_new_pages(result.new_pages);
  out->set_replicated_pages(result.replicated_pages);
  out->set_evicted_bytes(result.evicted_bytes);
}

absl::StatusOr<PinCall> ReleaseFromProto(const v1::ReleaseRequest& req) {
  PinCall call;
  KVCM_ASSIGN_OR_RETURN(
      call.ns, NamespaceFromProto(IfSet(req.has_namespace_(), req.namespace_()), "namespace"));
  KVCM_RETURN_IF_ERROR(ValidatePinId(req.pin_id()));
  call.pin_id = req.pin_id();
  return call;
}

absl::StatusOr<PinCall> RenewLeaseFromProto(const v1::RenewLeaseRequest& req,
                                            const RequestLimits& limits) {
  PinCall call;
  KVCM_ASSIGN_OR_RETURN(
      call.ns, NamespaceFromProto(IfSet(req.has_namespace_(), req.namespace_()), "namespace"));
  KVCM_RETURN_IF_ERROR(ValidatePinId(req.pin_id()));
  KVCM_RETURN_IF_ERROR(ValidateLeaseTtl(req.lease_ttl_ms(), "lease_ttl_ms", limits));
  call.pin_id = req.pin_id();
  call.lease_ttl = absl::Milliseconds(req.lease_ttl_ms());
  return call;
}

absl::StatusOr<EvictCall> EvictFromProto(const v1::EvictRequest& req) {
  EvictCall call;
  switch (req.target_case()) {
    case v1::EvictRequest::kPool: {
      KVCM_ASSIGN_OR_RETURN(call.target, PoolFromProto(&req.pool(), "pool"));
      break;
    }
    case v1::EvictRequest::kNamespace: {
      KVCM_ASSIGN_OR_RETURN(call.target, NamespaceFromProto(&req.namespace_(), "namespace"));
      break;
    }
    case v1::EvictRequest::TARGET_NOT_SET:
      return Invalid("target is required: set pool or namespace");
  }
  if (req.bytes() == 0) return Invalid("bytes must be > 0");
  call.bytes = req.bytes();
  return call;
}

absl::StatusOr<ReserveCall> ReserveFromProto(const v1::ReserveRequest& req) {
  ReserveCall call;
  KVCM_ASSIGN_OR_RETURN(call.pool, PoolFromProto(IfSet(req.has_pool(), req.pool()), "pool"));
  if (req.bytes() == 0) return Invalid("bytes must be > 0");
  call.bytes = req.bytes();
  if (!req.tenant().empty()) {
    KVCM_RETURN_IF_ERROR(ValidateName(req.tenant(), "tenant", "._-"));  // as namespace.tenant
    call.tenant = req.tenant();
  }
  return call;
}

void EvictResultToProto(const EvictResult& result, v1::EvictResponse* out) {
  out->set_evicted_bytes(result.evicted_bytes);
  out->set_evicted_pages(result.evicted_pages);
  out->set_demoted_pages(result.demoted_pages);
}

void StatsToProto(const IndexStats& stats, const RequestLimits& limits, v1::StatsResponse* out) {
  for (const PoolStats& p : stats.pools) {
    v1::PoolStats* ps = out->add_pools();
    PoolToProto(p.pool, ps->mutable_pool());
    ps->set_capacity_bytes(p.capacity_bytes);
    ps->set_used_bytes(p.used_bytes);
    ps->set_pinned_bytes(p.pinned_bytes);
    ps->set_reserved_bytes(p.reserved_bytes);
    ps->set_engine(p.engine);
    ps->set_pages(p.pages);
    ps->set_tenant_share_bytes(p.tenant_share_bytes);
  }
  for (const NamespaceStats& n : stats.namespaces) {
    v1::NamespaceStats* ns = out->add_namespaces();
    NamespaceToProto(n.ns, ns->mutable_namespace_());
    ModelSpecToProto(n.spec, ns->mutable_spec());
    ns->set_bytes_per_token(n.spec.BytesPerToken());
    ns->set_bytes_per_page(n.spec.BytesPerPage());
    ns->set_pages(n.pages);
    ns->set_page_locations(n.page_locations);
    ns->set_radix_nodes(n.radix_nodes);
    ns->set_max_page_age_s(static_cast<uint32_t>(absl::ToInt64Seconds(n.max_page_age)));
    ns->set_expired_pages(n.expired_pages);
  }
  for (const TenantStats& t : stats.tenants) {
    v1::TenantStats* ts = out->add_tenants();
    ts->set_tenant(t.tenant);
    ts->set_namespaces(t.namespaces);
    ts->set_stored_bytes(t.stored_bytes);
    ts->set_pinned_bytes(t.pinned_bytes);
    ts->set_reserved_bytes(t.reserved_bytes);
    ts->set_pins(t.pins);
    ts->set_max_bytes(stats.tenant_max_bytes);
    ts->set_max_pinned_bytes(stats.tenant_max_pinned_bytes);
    ts->set_engine_pages(t.engine_pages);
    ts->set_max_engine_pages(stats.max_engine_pages_per_tenant);
  }
  const IndexCounters& c = stats.counters;
  v1::Counters* pc = out->mutable_counters();
  pc->set_match_requests(c.match_requests);
  pc->set_requested_pages(c.requested_pages);
  pc->set_matched_pages(c.matched_pages);
  pc->set_inserted_pages(c.inserted_pages);
  pc->set_evicted_pages(c.evicted_pages);
  pc->set_demoted_pages(c.demoted_pages);
  pc->set_evicted_bytes(c.evicted_bytes);
  pc->set_pins_taken(c.pins_taken);
  pc->set_pins_released(c.pins_released);
  pc->set_lease_expiries(c.lease_expiries);
  pc->set_dropped_pages(c.dropped_pages);
  pc->set_expired_pages(c.expired_pages);
  pc->set_requested_tokens(c.requested_tokens);
  pc->set_matched_tokens(c.matched_tokens);
  pc->set_eviction_regret_pages(c.eviction_regret_pages);
  out->set_active_pins(stats.active_pins);
  out->set_policy(stats.policy);
  if (stats.selection.has_value()) {
    const SelectionStats& sel = *stats.selection;
    v1::PolicySelection* ps = out->mutable_selection();
    ps->set_active(sel.active);
    for (const SelectionStats::Candidate& candidate : sel.candidates) {
      v1::PolicySelection::Candidate* out_candidate = ps->add_candidates();
      out_candidate->set_name(candidate.name);
      out_candidate->set_shadow_hit_rate(candidate.hit_rate);
    }
    ps->set_switches(sel.switches);
    ps->set_sampled_lookup_pages(sel.sampled_lookup_pages);
    ps->set_sampled_store_pages(sel.sampled_store_pages);
    ps->set_shadow_pages(sel.shadow_pages);
    ps->set_pools(sel.pools);
    ps->set_min_sample_rate(sel.min_sample_rate);
  }
  v1::Limits* l = out->mutable_limits();
  l->set_max_tokens_per_request(limits.max_tokens_per_request);
  l->set_max_pages_per_request(limits.max_pages_per_request);
  l->set_max_lease_ttl_ms(limits.max_lease_ttl_ms);
  l->set_default_lease_ttl_ms(limits.default_lease_ttl_ms);
  l->set_default_tenant_pool_share_pct(stats.default_tenant_pool_share_pct);
  l->set_max_engine_pages_per_engine(stats.max_engine_pages_per_engine);
  l->set_max_engine_pages_per_tenant(stats.max_engine_pages_per_tenant);
  l->set_max_streams_per_principal(limits.max_streams_per_principal);
  l->set_grpc_max_connections(limits.grpc_max_connections);
  l->set_grpc_max_connections_per_peer(limits.grpc_max_connections_per_peer);
  l->set_grpc_handshake_timeout_ms(limits.grpc_handshake_timeout_ms);
  l->set_grpc_max_concurrent_streams(limits.grpc_max_concurrent_streams);
}

absl::StatusOr<std::optional<NamespaceId>> WatchFilterFromProto(const v1::WatchEventsRequest& req) {
  if (!req.has_namespace_()) return std::optional<NamespaceId>();
  KVCM_ASSIGN_OR_RETURN(NamespaceId ns, NamespaceFromProto(&req.namespace_(), "namespace"));
  return std::optional<NamespaceId>(std::move(ns));
}

void CacheEventToProto(const CacheEvent& event, uint64_t sequence, v1::CacheEvent* out) {
  out->set_kind(static_cast<v1::CacheEvent::Kind>(event.kind));
  NamespaceToProto(event.ns, out->mutable_namespace_());
  PoolToProto(event.pool, out->mutable_pool());
  out->set_page_hashes(EncodePageHashes(event.pages));
  out->set_sequence(sequence);
  out->set_reason(static_cast<v1::CacheEvent::Reason>(event.reason));
}

void AgentCommandToProto(const AgentCommand& command, uint64_t manager_incarnation,
                         v1::AgentCommand* out) {
  out->Clear();
  out->set_sequence(command.sequence);
  out->set_acked_through(command.acked_through);
  out->set_manager_incarnation(manager_incarnation);
  if (const auto* free = std::get_if<FreeBlocksCommand>(&command.body)) {
    out->mutable_free()->set_tier(TierToProto(free->tier));
    out->mutable_free()->mutable_block_ids()->Add(free->block_ids.begin(), free->block_ids.end());
  } else if (const auto* demote = std::get_if<DemoteBlocksCommand>(&command.body)) {
    out->mutable_demote()->mutable_source_block_ids()->Add(demote->source_block_ids.begin(),
                                                           demote->source_block_ids.end());
  } else if (const auto* commit = std::get_if<CommitBlocksCommand>(&command.body)) {
    v1::CommitBlocks* c = out->mutable_commit();
    c->set_committer(commit->committer);
    c->set_tier(TierToProto(commit->tier));
    c->mutable_namespace_()->set_tenant(commit->ns.tenant);
    c->mutable_namespace_()->set_model(commit->ns.model);
    ModelSpecToProto(commit->spec, c->mutable_spec());
    c->mutable_block_ids()->Add(commit->block_ids.begin(), commit->block_ids.end());
    c->set_page_hashes(EncodePageHashes(commit->pages));
    if (commit->first_parent != PageHash{}) {
      c->set_first_parent_hash(EncodePageHashes({&commit->first_parent, 1}));
    }
    c->set_committed_unix_ms(commit->committed_unix_ms);
    c->set_max_page_age_s(commit->max_page_age_s);
  } else if (const auto* release = std::get_if<ReleaseBlocksCommand>(&command.body)) {
    out->mutable_release()->set_tier(TierToProto(release->tier));
    out->mutable_release()->mutable_block_ids()->Add(release->block_ids.begin(),
                                                     release->block_ids.end());
  }
}

AgentCommandAck AgentCommandAckFromProto(const v1::AgentCommandAck& ack) {
  AgentCommandAck out{.sequence = ack.sequence()};
  if (ack.code() != 0) {
    constexpr int32_t kMaxCode = static_cast<int32_t>(absl::StatusCode::kUnauthenticated);
    const absl::StatusCode code = ack.code() > 0 && ack.code() <= kMaxCode
                                      ? static_cast<absl::StatusCode>(ack.code())
                                      : absl::StatusCode::kUnknown;
    out.status = absl::Status(code, ack.message());
  }
  out.block_ids.assign(ack.block_ids().begin(), ack.block_ids().end());
  return out;
}

absl::StatusOr<EnginePublish> EnginePublishFromProto(const CacheIndex& index,
                                                     const v1::PublishEngineEventsRequest& req,
                                                     const RequestLimits& limits) {
  EnginePublish call;
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.engine_id(), "engine_id"));
  call.engine_id = req.engine_id();
  KVCM_ASSIGN_OR_RETURN(
      call.ns, NamespaceFromProto(IfSet(req.has_namespace_(), req.namespace_()), "namespace"));
  if (req.session() == 0) return Invalid("session must be non-zero");
  if (req.sequence() == 0) return Invalid("sequence must be at least 1");
  if (req.ttl_ms() > absl::ToInt64Milliseconds(kMaxEngineSessionTtl)) {
    return Invalid(absl::StrCat("ttl_ms ", req.ttl_ms(), " exceeds ",
                                absl::ToInt64Milliseconds(kMaxEngineSessionTtl)));
  }
  call.session = req.session();
  call.sequence = req.sequence();
  call.ttl = absl::Milliseconds(req.ttl_ms());
  call.close = req.close();
  if (req.changes_size() > kMaxEngineChanges) {
    return Invalid(
        absl::StrCat("changes: at most ", kMaxEngineChanges, ", got ", req.changes_size()));
  }
  for (int i = 0; i < req.changes_size(); ++i) {
    const v1::EngineChange& c = req.changes(i);
    const std::string field = absl::StrCat("changes[", i, "]");
    EngineChange& out = call.changes.emplace_back();
    switch (c.kind()) {
      case v1::EngineChange::KIND_STORED:
        out.kind = EngineChange::Kind::kStored;
        break;
      case v1::EngineChange::KIND_REMOVED:
        out.kind = EngineChange::Kind::kRemoved;
        break;
      case v1::EngineChange::KIND_CLEARED:
        out.kind = EngineChange::Kind::kCleared;
        break;
      default:
        return Invalid(absl::StrCat(field,
                                    ".kind must be KIND_STORED, KIND_REMOVED or KIND_CLEARED, got ",
                                    static_cast<int>(c.kind())));
    }
    v1::PoolRef pool;
    pool.set_agent_id(req.engine_id());
    pool.set_tier(c.tier());
    KVCM_ASSIGN_OR_RETURN(PoolKey key, PoolFromProto(&pool, field));
    out.tier = key.tier;
    const std::string& bytes = c.page_hashes();
    if (out.kind == EngineChange::Kind::kCleared) {
      if (!bytes.empty())
        return Invalid(absl::StrCat(field, ".page_hashes must be empty for KIND_CLEARED"));
      continue;
    }
    if (bytes.empty() || bytes.size() % 16 != 0) {
      return Invalid(absl::StrCat(
          field, ".page_hashes must be a non-empty multiple of 16 bytes, got ", bytes.size()));
    }
    if (bytes.size() / 16 > limits.max_pages_per_request) {
      return Invalid(absl::StrCat(field, ".page_hashes holds ", bytes.size() / 16,
                                  " pages, more than max_pages_per_request (",
                                  limits.max_pages_per_request, ")"));
    }
    out.pages = DecodePageHashes(bytes);
  }
  if (!req.has_scheme()) return Invalid("scheme is required");
  KVCM_ASSIGN_OR_RETURN(RegisterModelResult info, index.GetNamespace(call.ns));
  KVCM_RETURN_IF_ERROR(CheckScheme(req.scheme(), info, "scheme"));
  return call;
}

void EngineSessionsToProto(std::span<const EngineSessionInfo> sessions, absl::Time now,
                           v1::StatsResponse* out) {
  for (const EngineSessionInfo& s : sessions) {
    v1::EngineStats* e = out->add_engines();
    e->set_engine_id(s.engine_id);
    e->mutable_namespace_()->set_tenant(s.ns.tenant);
    e->mutable_namespace_()->set_model(s.ns.model);
    e->set_session(s.session);
    e->set_sequence(s.sequence);
    e->set_last_publish_age_ms(static_cast<uint64_t>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(now - s.last_publish))));
    e->set_ttl_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(s.ttl)));
    e->set_pages(s.pages);
  }
}

}  // namespace kvcm
