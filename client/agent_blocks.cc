#include "client/agent_blocks.h"

#include <chrono>

#include "common/credentials.h"
#include "common/grpc_status.h"

namespace kvcm {
namespace {

constexpr auto kCallTimeout = std::chrono::seconds(10);

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + kCallTimeout);
}

}  // namespace

absl::StatusOr<AgentBlocks> AgentBlocks::Allocate(const std::string& address, const NamespaceId& ns,
                                                  uint32_t count) {
  AgentBlocks out;
  out.stub_ = v1::BlockAgent::NewStub(MakeChannel(address));
  v1::BlockAgentStatsResponse stats;
  {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    if (grpc::Status s = out.stub_->Stats(&ctx, v1::BlockAgentStatsRequest(), &stats); !s.ok()) {
      return FromGrpcStatus(s);
    }
  }
  out.epoch_ = stats.epoch();
  v1::AllocateBlocksRequest req;
  req.set_count(count);
  req.set_owner_epoch(out.epoch_);
  req.mutable_namespace_()->set_tenant(ns.tenant);
  req.mutable_namespace_()->set_model(ns.model);
  v1::AllocateBlocksResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  if (grpc::Status s = out.stub_->Allocate(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
  out.ids_.assign(resp.block_ids().begin(), resp.block_ids().end());
  return out;
}

absl::Status AgentBlocks::Free(std::span<const BlockId> ids) {
  if (ids.empty()) return absl::OkStatus();
  v1::FreeBlocksRequest req;
  req.mutable_block_ids()->Add(ids.begin(), ids.end());
  req.set_owner_epoch(epoch_);
  v1::FreeBlocksResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  return FromGrpcStatus(stub_->Free(&ctx, req, &resp));
}

}  // namespace kvcm
