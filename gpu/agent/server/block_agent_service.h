// BlockAgentService: the kvcm.v1.BlockAgent gRPC service over the agent's pools. Allocate,
// Free, RunAttention and Stats are each one call of RpcRunner::Unary (Allocate of UnaryAsync: a
// store into a full pool waits in the RoomMaker while the manager evicts) (common/rpc_runner.h),
// which times the body, records the RPC metrics, logs failures at a bounded rate and finishes
// with the body's status; WriteBlocks and ReadBlocks start the reactors of
// block_stream_reactors.h, which record their outcome through the same runner. Every handler
// first authenticates the caller (Authenticator), then runs its body (below, without gRPC),
// which first authorizes the call (block_agent_access.h): UNAUTHENTICATED or PERMISSION_DENIED, and
// nothing changed, otherwise. Allocate answers each block's generation; the other calls take them
// back (block_agent_access.h) and the pool checks them with the work. WriteBlocks and ReadBlocks
// streams count against max_streams_per_principal.
//
// Thread-safe: gRPC calls the handlers concurrently; the pools, the epoch and the metrics are
// thread-safe.
#ifndef KVCM_GPU_AGENT_SERVER_BLOCK_AGENT_SERVICE_H_
#define KVCM_GPU_AGENT_SERVER_BLOCK_AGENT_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "common/authenticator.h"
#include "common/rpc_runner.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/control/room_maker.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/fetcher.h"
#include "gpu/agent/server/stream_limiter.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

// The bodies of BlockAgentService's handlers for an authenticated caller, without gRPC (the
// streams' are WriteBlocksStage and ReadBlocksStage, block_stream_reactors.h), shared with
// the BlockAgent fuzzer (fuzz/block_agent_fuzzer.cc) so that it fuzzes these and no copy.
// Each authorizes the caller (block_agent_access.h) before it validates or touches anything.
//
// AllocateRequestOf: authorized (AuthorizeAllocate) and converted, with the caller as the
// blocks' allocator; the caller's deadline is the RPC's, set by the service.
absl::StatusOr<RoomMaker::Request> AllocateRequestOf(const Principal& caller,
                                                     const v1::AllocateBlocksRequest& req);
// FreeBlocksAs: the id count bounded, generations required of workers (RequireGenerations),
// every block authorized (AuthorizeBlocks), then BlockPool::Free of the main pool.
absl::Status FreeBlocksAs(const Principal& caller, BlockPool& pool,
                          const v1::FreeBlocksRequest& req);
// RunAttentionAs: each row's generations, when given, required well-formed of workers, every
// row authorized (AuthorizeRunAttention), then the MLA decode over `pool` (the main pool) in
// the generations authorization bound.
absl::Status RunAttentionAs(const Principal& caller, BlockPool& pool,
                            const v1::RunAttentionRequest& req, v1::RunAttentionResponse* resp);
// FetchAs: local_block_generations, when given, required well-formed of workers, the call
// authorized into `pool` (AuthorizeFetch; the pool req.tier names, may be null), then
// `fetcher`'s Fetch (UNIMPLEMENTED when null), filling `resp`. `finish` runs exactly once,
// inline or on the fetch's thread; `resp` must live until it has.
void FetchAs(const Principal& caller, BlockPool* pool, Fetcher* fetcher,
             const v1::FetchRequest& req, v1::FetchResponse* resp,
             std::function<void(const absl::Status&)> finish);
// StatsOf: the pools' geometry and usage, the epoch and the stream limits (any caller).
void StatsOf(const AgentOptions& options, AgentPools pools, const AgentEpoch& epoch,
             v1::BlockAgentStatsResponse* resp);

// The pool `tier` names on an agent whose main pool is of `main_tier`: the main pool for
// TIER_UNSPECIFIED or its own tier, the host pool for TIER_HOST; null when the agent has none.
BlockPool* PoolOfTier(const AgentPools& pools, Tier main_tier, v1::Tier tier);

class BlockAgentService final : public v1::BlockAgent::CallbackService {
 public:
  // None of the pointers is owned; all must outlive the service. Fetch answers
  // UNIMPLEMENTED when `fetcher` is null (an agent without a transport). A null
  // `authenticator` lets every caller do everything (as Authenticator::Open()). Allocate
  // goes through `room_maker` (null: straight to the pool, a short pool answers
  // RESOURCE_EXHAUSTED).
  BlockAgentService(const AgentOptions* options, AgentPools pools, const AgentEpoch* epoch,
                    AgentMetrics* metrics, Fetcher* fetcher = nullptr,
                    const Authenticator* authenticator = nullptr, RoomMaker* room_maker = nullptr);

  grpc::ServerUnaryReactor* Allocate(grpc::CallbackServerContext* ctx,
                                     const v1::AllocateBlocksRequest* req,
                                     v1::AllocateBlocksResponse* resp) override;
  grpc::ServerUnaryReactor* Free(grpc::CallbackServerContext* ctx, const v1::FreeBlocksRequest* req,
                                 v1::FreeBlocksResponse* resp) override;
  grpc::ServerReadReactor<v1::WriteBlocksRequest>* WriteBlocks(
      grpc::CallbackServerContext* ctx, v1::WriteBlocksResponse* resp) override;
  grpc::ServerWriteReactor<v1::ReadBlocksResponse>* ReadBlocks(
      grpc::CallbackServerContext* ctx, const v1::ReadBlocksRequest* req) override;
  grpc::ServerUnaryReactor* RunAttention(grpc::CallbackServerContext* ctx,
                                         const v1::RunAttentionRequest* req,
                                         v1::RunAttentionResponse* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx,
                                  const v1::BlockAgentStatsRequest* req,
                                  v1::BlockAgentStatsResponse* resp) override;
  grpc::ServerUnaryReactor* Fetch(grpc::CallbackServerContext* ctx, const v1::FetchRequest* req,
                                  v1::FetchResponse* resp) override;

  // WriteBlocks and ReadBlocks streams `principal` (its name) holds open now, as
  // max_streams_per_principal counts them: a stream counts from the moment its reactor
  // starts until the reactor ends, which is after its client has seen it finish.
  uint32_t open_streams(const std::string& principal) const { return streams_.open(principal); }

 private:
  // The authenticated, authorized and converted Allocate request.
  absl::StatusOr<RoomMaker::Request> AllocateRequest(const grpc::CallbackServerContext& ctx,
                                                     const v1::AllocateBlocksRequest& req) const;

  const AgentOptions& options_;
  const AgentPools pools_;
  const AgentEpoch* const epoch_;
  RpcRunner<AgentRpc> rpc_;
  Fetcher* const fetcher_;
  RoomMaker* const room_maker_;
  const Authenticator* const authenticator_;
  StreamLimiter streams_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_BLOCK_AGENT_SERVICE_H_
