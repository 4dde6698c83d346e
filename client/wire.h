// Conversions between the client's C++ types and the kvcm.v1 protos. Internal to
// kvcm_client. All functions are pure and thread-safe.
#ifndef KVCM_CLIENT_WIRE_H_
#define KVCM_CLIENT_WIRE_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "client/client.h"
#include "grpcpp/support/status.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "kvcm/v1/common.pb.h"
#include "proto/core_types.h"

namespace kvcm::wire {

NamespaceId FromProto(const v1::Namespace& ns);
PoolRef FromProto(const v1::PoolRef& pool);
ModelSpec FromProto(const v1::ModelSpec& spec);

// Fills `out` with tokens, for the manager to hash.
void SetTokens(std::span<const int32_t> tokens, v1::Prompt* out);
// Fills `out` with page hashes and the scheme that proves how they were made.
void SetHashes(std::span<const PageHash> pages, uint32_t page_size_tokens, uint64_t key_fingerprint,
               v1::Prompt* out);

MatchReply FromProto(const v1::MatchResponse& response);
RouteReply FromProto(const v1::RouteResponse& response);
InsertReply FromProto(const v1::InsertResponse& response);
EvictReply FromProto(const v1::EvictResponse& response);
ManagerStats FromProto(const v1::StatsResponse& response);
WatchedEvent FromProto(const v1::CacheEvent& event);

}  // namespace kvcm::wire

#endif  // KVCM_CLIENT_WIRE_H_
