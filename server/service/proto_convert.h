// Conversions between the kvcm.v1 protos and the core's types, with the validation that
// makes bad input INVALID_ARGUMENT (or FAILED_PRECONDITION for a foreign hash scheme) with a
// message naming the field path, before anything reaches the core.
//
// The *FromProto functions for requests check everything a request carries and only then
// look the namespace up (NOT_FOUND comes from the core), so a rejected request changes
// nothing. All functions are thread-safe (they only read the CacheIndex).
#ifndef KVCM_SERVER_SERVICE_PROTO_CONVERT_H_
#define KVCM_SERVER_SERVICE_PROTO_CONVERT_H_

#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvcm/v1/agent.pb.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "kvcm/v1/common.pb.h"
#include "proto/core_types.h"
#include "server/core/agent_command.h"
#include "server/core/agent_inserter.h"
#include "server/core/cache_index.h"
#include "server/core/engine_sessions.h"
#include "server/core/router.h"

namespace kvcm {

// Per-request size limits (from ServerOptions), enforced on every call and reported by Stats,
// with the connection and stream limits in force (reported only; enforced by gRPC, the accept4
// guard and the stream slots: common/server_limits.h, common/stream_slots.h).
struct RequestLimits {
  uint32_t max_tokens_per_request = 1u << 20;
  uint32_t max_pages_per_request = 65'536;
  uint32_t max_lease_ttl_ms = 600'000;
  uint32_t default_lease_ttl_ms = 30'000;
  uint32_t max_streams_per_principal = 0;
  uint32_t grpc_max_connections = 0;  // after the RLIMIT_NOFILE cap
  uint32_t grpc_max_connections_per_peer = 0;
  uint32_t grpc_handshake_timeout_ms = 0;
  uint32_t grpc_max_concurrent_streams = 0;
};

// ---- Shared types. `field` is the path used in error messages, e.g. "namespace". ----

// NamespaceFromProto and ModelSpecFromProto: proto/core_types.h.

// agent_id 1..128 bytes of [A-Za-z0-9._:-].
absl::Status ValidateAgentId(absl::string_view agent_id, absl::string_view field);

// Missing pool, bad agent_id, or tier not GPU/HOST/DISK -> INVALID_ARGUMENT.
absl::StatusOr<PoolKey> PoolFromProto(const v1::PoolRef* pool, absl::string_view field);

// A prompt as the namespace's chained page hashes.
struct ResolvedPrompt {
  std::vector<PageHash> pages;  // whole pages only
  uint32_t page_size_tokens = 0;
};

// Field "prompt". In order: shape checks (present, non-empty, page_hashes a multiple of 16
// bytes, within max_tokens_per_request / max_pages_per_request, scheme present with hashes);
// namespace lookup (NOT_FOUND); scheme checks (version -> FAILED_PRECONDITION, page size ->
// INVALID_ARGUMENT, key fingerprint -> FAILED_PRECONDITION); hashing of tokens.
absl::StatusOr<ResolvedPrompt> ResolvePrompt(const CacheIndex& index, const NamespaceId& ns,
                                             const v1::Prompt* prompt, const RequestLimits& limits);

// ---- Requests and responses, one group per RPC. ----

struct RegisterModelCall {
  NamespaceId ns;
  ModelSpec spec;
  absl::Duration max_page_age = absl::ZeroDuration();  // 0: the manager's default
};
// Also INVALID_ARGUMENT "max_page_age_s" beyond kMaxPageAgeS.
absl::StatusOr<RegisterModelCall> RegisterModelFromProto(const v1::RegisterModelRequest& req);
void RegisterModelResultToProto(const RegisterModelResult& result, v1::RegisterModelResponse* out);

struct MatchCall {
  NamespaceId ns;
  ResolvedPrompt prompt;
  MatchOptions options;
};
absl::StatusOr<MatchCall> MatchFromProto(const CacheIndex& index, const v1::MatchRequest& req,
                                         const RequestLimits& limits);
void MatchResultToProto(const MatchResult& result, uint32_t page_size_tokens,
                        v1::MatchResponse* out);

struct RouteCall {
  NamespaceId ns;
  ResolvedPrompt prompt;
  struct Candidate {
    std::string agent_id;
    uint64_t load = 0;
    uint64_t queued_prefill_tokens = 0;
  };
  std::vector<Candidate> candidates;  // empty: every live agent
  RoutePolicy policy = RoutePolicy::kPrefillSaved;
  double prefill_tokens_per_s = 0;  // 0: the manager's default
  bool probe = false;
  bool pin = false;
  absl::Duration lease_ttl = absl::ZeroDuration();
};
// Most candidates one Route may name.
inline constexpr int kMaxRouteCandidates = 256;
// Also INVALID_ARGUMENT for more than kMaxRouteCandidates candidates, a bad or repeated
// candidates[i].agent_id, an unknown policy, a negative or non-finite prefill_tokens_per_s,
// and probe with pin. Candidates are not looked up here (the service checks they are live).
absl::StatusOr<RouteCall> RouteFromProto(const CacheIndex& index, const v1::RouteRequest& req,
                                         const RequestLimits& limits);
// One ranked candidate; `candidate` is what the caller sent for it.
void RouteEstimateToProto(const RouteEstimate& estimate, const RouteCandidate& candidate,
                          v1::RankedAgent* out);

struct InsertCall {
  NamespaceId ns;
  ResolvedPrompt prompt;
  PoolKey pool;
  std::vector<BlockId> block_ids;  // one per page of prompt.pages, distinct
  bool use_reservation = false;
  uint64_t agent_epoch = 0;
};
// Also INVALID_ARGUMENT when the prompt has no whole page, or block_ids is not one distinct
// id per page or holds 0xFFFFFFFF.
absl::StatusOr<InsertCall> InsertFromProto(const CacheIndex& index, const v1::InsertRequest& req,
                                           const RequestLimits& limits);
// What the AgentInserter runs for a checked call.
InsertCommand ToInsertCommand(InsertCall call);
void InsertResultToProto(const InsertResult& result, v1::InsertResponse* out);

// Release and RenewLease.
struct PinCall {
  NamespaceId ns;
  PinId pin_id = 0;
  absl::Duration lease_ttl = absl::ZeroDuration();  // RenewLease only; 0: the default
};
absl::StatusOr<PinCall> ReleaseFromProto(const v1::ReleaseRequest& req);
absl::StatusOr<PinCall> RenewLeaseFromProto(const v1::RenewLeaseRequest& req,
                                            const RequestLimits& limits);

struct EvictCall {
  std::variant<PoolKey, NamespaceId> target;
  uint64_t bytes = 0;  // > 0
};
absl::StatusOr<EvictCall> EvictFromProto(const v1::EvictRequest& req);

struct ReserveCall {
  PoolKey pool;
  uint64_t bytes = 0;
  // The request's tenant field, validated when set; whose reservation it is depends on the
  // caller too (ReservationTenant in access_control.h).
  std::string tenant;
};
// Reserve and Unreserve share a request.
absl::StatusOr<ReserveCall> ReserveFromProto(const v1::ReserveRequest& req);
void EvictResultToProto(const EvictResult& result, v1::EvictResponse* out);

void StatsToProto(const IndexStats& stats, const RequestLimits& limits, v1::StatsResponse* out);

// Most changes one PublishEngineEvents may carry.
inline constexpr int kMaxEngineChanges = 4096;
// Field paths as in the proto: engine_id (an agent id's syntax), namespace, session and
// sequence non-zero, changes (at most kMaxEngineChanges; kind known; tier GPU/HOST/DISK;
// page_hashes a multiple of 16 bytes, 1..max_pages_per_request pages for STORED and
// REMOVED, empty for CLEARED), ttl_ms at most kMaxEngineSessionTtl; then the namespace
// (NOT_FOUND) and the scheme as ResolvePrompt checks it, field "scheme".
absl::StatusOr<EnginePublish> EnginePublishFromProto(const CacheIndex& index,
                                                     const v1::PublishEngineEventsRequest& req,
                                                     const RequestLimits& limits);
void EngineSessionsToProto(std::span<const EngineSessionInfo> sessions, absl::Time now,
                           v1::StatsResponse* out);

// The namespace filter of WatchEvents: nullopt (every namespace) when unset.
absl::StatusOr<std::optional<NamespaceId>> WatchFilterFromProto(const v1::WatchEventsRequest& req);
void CacheEventToProto(const CacheEvent& event, uint64_t sequence, v1::CacheEvent* out);

// ---- AgentControl.Commands. ----

void AgentCommandToProto(const AgentCommand& command, uint64_t manager_incarnation,
                         v1::AgentCommand* out);
// An ack (not the hello): code 0 is OK, any other code an error with `message` (a code
// outside google.rpc.Code becomes UNKNOWN).
AgentCommandAck AgentCommandAckFromProto(const v1::AgentCommandAck& ack);

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_PROTO_CONVERT_H_
