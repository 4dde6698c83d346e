#include "gpu/agent/server/block_agent_service.h"

#include <optional>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu/agent/control/agent_proto.h"
#include "gpu/agent/pool/pool_attention.h"
#include "gpu/agent/server/block_agent_access.h"
#include "gpu/agent/server/block_stream_reactors.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

// Most block ids one Free may carry, so a request's size is bounded.
constexpr int kMaxIdsPerRequest = 1 << 20;

const Authenticator* OpenAuthenticator() {
  static const Authenticator* const open = Authenticator::Open().release();
  return open;
}

}  // namespace

BlockAgentService::BlockAgentService(const AgentOptions* options, AgentPools pools,
                                     const AgentEpoch* epoch, AgentMetrics* metrics,
                                     Fetcher* fetcher, const Authenticator* authenticator,
                                     RoomMaker* room_maker)
    : options_(*options),
      pools_(pools),
      epoch_(epoch),
      rpc_(metrics->rpcs()),
      fetcher_(fetcher),
      room_maker_(room_maker),
      authenticator_(authenticator != nullptr ? authenticator : OpenAuthenticator()),
      streams_(options->max_streams_per_principal) {}

BlockPool* PoolOfTier(const AgentPools& pools, Tier main_tier, v1::Tier tier) {
  if (tier == v1::TIER_UNSPECIFIED || tier == TierToProto(main_tier)) return pools.main;
  return tier == v1::TIER_HOST ? pools.host : nullptr;
}

void FetchAs(const Principal& caller, BlockPool* pool, Fetcher* fetcher,
             const v1::FetchRequest& req, v1::FetchResponse* resp,
             std::function<void(const absl::Status&)> finish) {
  if (absl::Status s =
          RequireGenerations(caller, req.local_block_ids_size(),
                             std::span<const uint64_t>(req.local_block_generations().data(),
                                                       req.local_block_generations_size()),
                             "local_block_generations");
      !s.ok() && req.local_block_generations_size() > 0) {
    // Optional (FetchRequest): checked only when given.
    return finish(s);
  }
  if (absl::Status s = AuthorizeFetch(caller, pool, req); !s.ok()) return finish(s);
  if (fetcher == nullptr) return finish(absl::UnimplementedError("this agent has no transport"));
  fetcher->Fetch(req, [resp, finish = std::move(finish)](absl::StatusOr<FetchResult> r) {
    if (r.ok()) {
      resp->mutable_block_ids()->Add(r->block_ids.begin(), r->block_ids.end());
      resp->set_fetched_pages(r->fetched_pages);
      resp->set_bytes(r->bytes);
    }
    finish(r.status());
  });
}

grpc::ServerUnaryReactor* BlockAgentService::Fetch(grpc::CallbackServerContext* ctx,
                                                   const v1::FetchRequest* req,
                                                   v1::FetchResponse* resp) {
  return rpc_.UnaryAsync(ctx, AgentRpc::kFetch,
                         [&](std::function<void(const absl::Status&)> finish) {
                           absl::StatusOr<std::shared_ptr<const Principal>> caller =
                               authenticator_->Authenticate(*ctx);
                           if (!caller.ok()) {
                             finish(caller.status());
                             return;
                           }
                           FetchAs(**caller, PoolOfTier(pools_, options_.tier, req->tier()),
                                   fetcher_, *req, resp, std::move(finish));
                         });
}

grpc::ServerUnaryReactor* BlockAgentService::Allocate(grpc::CallbackServerContext* ctx,
                                                      const v1::AllocateBlocksRequest* req,
                                                      v1::AllocateBlocksResponse* resp) {
  return rpc_.UnaryAsync(
      ctx, AgentRpc::kAllocate, [&](std::function<void(const absl::Status&)> finish) {
        absl::StatusOr<RoomMaker::Request> request = AllocateRequest(*ctx, *req);
        if (!request.ok()) {
          finish(request.status());
          return;
        }
        auto done = [resp, finish](absl::StatusOr<RoomMaker::Allocation> r) {
          if (r.ok()) {
            resp->mutable_block_ids()->Add(r->block_ids.begin(), r->block_ids.end());
            resp->mutable_block_generations()->Add(r->generations.begin(), r->generations.end());
          }
          finish(r.status());
        };
        if (room_maker_ != nullptr) {
          room_maker_->Allocate(*std::move(request), std::move(done));
          return;
        }
        done(RoomMaker::AllocateNow(*pools_.main, *request));
      });
}

absl::StatusOr<RoomMaker::Request> AllocateRequestOf(const Principal& caller,
                                                     const v1::AllocateBlocksRequest& req) {
  KVCM_RETURN_IF_ERROR(AuthorizeAllocate(caller, req));
  RoomMaker::Request request{
      .count = req.count(), .owner_epoch = req.owner_epoch(), .allocator = AllocatorName(caller)};
  // With a namespace the blocks can be committed to its pages; without, they stay private.
  if (req.has_namespace_()) {
    KVCM_ASSIGN_OR_RETURN(request.ns, NamespaceFromProto(&req.namespace_(), "namespace"));
  }
  return request;
}

absl::Status FreeBlocksAs(const Principal& caller, BlockPool& pool,
                          const v1::FreeBlocksRequest& req) {
  if (req.block_ids_size() > kMaxIdsPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_ids must list at most ", kMaxIdsPerRequest, " ids"));
  }
  const std::span<const BlockId> ids(req.block_ids().data(), req.block_ids_size());
  const std::span<const uint64_t> gens(req.block_generations().data(),
                                       req.block_generations_size());
  KVCM_RETURN_IF_ERROR(RequireGenerations(caller, ids.size(), gens, "block_generations"));
  KVCM_RETURN_IF_ERROR(AuthorizeBlocks(caller, &pool, ids, "free blocks", gens));
  return pool.Free(ids, req.owner_epoch(), gens);
}

absl::StatusOr<RoomMaker::Request> BlockAgentService::AllocateRequest(
    const grpc::CallbackServerContext& ctx, const v1::AllocateBlocksRequest& req) const {
  KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller, authenticator_->Authenticate(ctx));
  KVCM_ASSIGN_OR_RETURN(RoomMaker::Request request, AllocateRequestOf(*caller, req));
  if (ctx.deadline() != std::chrono::system_clock::time_point::max()) {
    request.deadline = absl::FromChrono(ctx.deadline());
  }
  return request;
}

grpc::ServerUnaryReactor* BlockAgentService::Free(grpc::CallbackServerContext* ctx,
                                                  const v1::FreeBlocksRequest* req,
                                                  v1::FreeBlocksResponse* /*resp*/) {
  return rpc_.Unary(ctx, AgentRpc::kFree, [&]() -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller,
                          authenticator_->Authenticate(*ctx));
    return FreeBlocksAs(*caller, *pools_.main, *req);
  });
}

grpc::ServerReadReactor<v1::WriteBlocksRequest>* BlockAgentService::WriteBlocks(
    grpc::CallbackServerContext* ctx, v1::WriteBlocksResponse* resp) {
  return new WriteBlocksReactor(&options_, pools_.main, &rpc_, ctx, resp,
                                authenticator_->Authenticate(*ctx), &streams_);
}

grpc::ServerWriteReactor<v1::ReadBlocksResponse>* BlockAgentService::ReadBlocks(
    grpc::CallbackServerContext* ctx, const v1::ReadBlocksRequest* req) {
  absl::StatusOr<ReadBlocksStage> stage = absl::UnknownError("unset");
  StreamLimiter::Slot slot;
  if (absl::StatusOr<std::shared_ptr<const Principal>> caller = authenticator_->Authenticate(*ctx);
      !caller.ok()) {
    stage = caller.status();
  } else if (absl::StatusOr<StreamLimiter::Slot> s = streams_.Acquire((*caller)->name); !s.ok()) {
    stage = s.status();
  } else {
    slot = *std::move(s);
    stage = ReadBlocksStage::Open(&options_, PoolOfTier(pools_, options_.tier, req->tier()),
                                  **caller, *req);
  }
  return new ReadBlocksReactor(&rpc_, std::move(stage), std::move(slot));
}

absl::Status RunAttentionAs(const Principal& caller, BlockPool& pool,
                            const v1::RunAttentionRequest& req, v1::RunAttentionResponse* resp) {
  for (int i = 0; i < req.block_table_size(); ++i) {
    const v1::BlockList& row = req.block_table(i);
    if (row.block_generations_size() > 0) {
      KVCM_RETURN_IF_ERROR(RequireGenerations(
          caller, row.block_ids_size(),
          std::span<const uint64_t>(row.block_generations().data(), row.block_generations_size()),
          absl::StrCat("block_table[", i, "].block_generations")));
    }
  }
  PoolAttentionRequest in;
  // Optional, as for ReadBlocks; the kernel runs in the generations bound here.
  KVCM_RETURN_IF_ERROR(AuthorizeRunAttention(caller, pool, req, &in.block_generations));
  in.block_table.reserve(req.block_table_size());
  for (const v1::BlockList& row : req.block_table()) {
    in.block_table.emplace_back(row.block_ids().begin(), row.block_ids().end());
  }
  in.seq_lens.assign(req.seq_lens().begin(), req.seq_lens().end());
  in.query_bf16 = std::as_bytes(std::span<const char>(req.query()));
  in.softmax_scale = req.softmax_scale();
  in.num_heads = req.num_heads();
  in.layer = req.layer();
  in.owner_epoch = req.owner_epoch();
  KVCM_ASSIGN_OR_RETURN(PoolAttentionResult out, RunMlaDecodeOnPool(pool, in));
  resp->set_output(out.output.data(), out.output.size() * sizeof(float));
  resp->mutable_lse()->Add(out.lse.begin(), out.lse.end());
  resp->set_backend(pool.backend().name());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* BlockAgentService::RunAttention(grpc::CallbackServerContext* ctx,
                                                          const v1::RunAttentionRequest* req,
                                                          v1::RunAttentionResponse* resp) {
  return rpc_.Unary(ctx, AgentRpc::kRunAttention, [&]() -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller,
                          authenticator_->Authenticate(*ctx));
    return RunAttentionAs(*caller, *pools_.main, *req, resp);
  });
}

void StatsOf(const AgentOptions& options, AgentPools pools, const AgentEpoch& epoch,
             v1::BlockAgentStatsResponse* resp) {
  const BlockPoolStats s = pools.main->Stats();
  resp->set_agent_id(options.agent_id);
  resp->set_epoch(epoch.current());
  resp->set_backend(pools.main->backend().name());
  PoolGeometryToProto(pools.main->geometry(), resp->mutable_geometry());
  resp->set_capacity_bytes(s.capacity_bytes);
  resp->set_used_bytes(s.used_bytes);
  resp->set_free_blocks(s.free_blocks);
  resp->set_registered(epoch.registered());
  if (const BlockPool* host = pools.host; host != nullptr) {
    const BlockPoolStats h = host->Stats();
    v1::HostPoolStats* out = resp->mutable_host_pool();
    out->set_num_blocks(h.num_blocks);
    out->set_used_bytes(h.used_bytes);
    out->set_free_blocks(h.free_blocks);
  }
  v1::BlockStreamLimits* limits = resp->mutable_stream_limits();
  limits->set_max_streams_per_principal(options.max_streams_per_principal);
  limits->set_max_message_bytes(options.max_message_bytes);
  limits->set_read_chunk_bytes(options.read_chunk_bytes);
  limits->set_max_blocks_per_call(options.max_blocks_per_call);
}

grpc::ServerUnaryReactor* BlockAgentService::Stats(grpc::CallbackServerContext* ctx,
                                                   const v1::BlockAgentStatsRequest* /*req*/,
                                                   v1::BlockAgentStatsResponse* resp) {
  return rpc_.Unary(ctx, AgentRpc::kStats, [&]() -> absl::Status {
    // Any authenticated caller: the answer names no tenant.
    KVCM_RETURN_IF_ERROR(authenticator_->Authenticate(*ctx).status());
    StatsOf(options_, pools_, *epoch_, resp);
    return absl::OkStatus();
  });
}

}  // namespace kvcm
