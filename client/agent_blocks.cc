#include "client/agent_blocks.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/tls_hint.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

constexpr auto kCallTimeout = std::chrono::seconds(10);

void SetDeadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + kCallTimeout);
}

}  // namespace

absl::StatusOr<AgentBlocks> AgentBlocks::Allocate(const ChannelFactory& channels,
                                                  const std::string& address, const NamespaceId& ns,
                                                  uint32_t count) {
  AgentBlocks out;
  out.stub_ = v1::BlockAgent::NewStub(channels.Open(address));
  v1::BlockAgentStatsResponse stats;
  {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    if (grpc::Status s = out.stub_->Stats(&ctx, v1::BlockAgentStatsRequest(), &stats); !s.ok()) {
      // The first call to the agent: where a TLS/plaintext mismatch shows.
      return WithTlsMismatchHint(FromGrpcStatus(s), channels.insecure(), "the agent");
    }
  }
  out.epoch_ = stats.epoch();
  out.bytes_per_block_ = stats.geometry().bytes_per_block();
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
  out.generations_.assign(resp.block_generations().begin(), resp.block_generations().end());
  return out;
}

absl::Status AgentBlocks::Fill(std::byte byte) {
  constexpr size_t kBlocksPerStream = 16;
  constexpr size_t kChunkBytes = 1 << 20;  // below every agent's max_message_bytes
  if (bytes_per_block_ == 0) return absl::FailedPreconditionError("no block size known");
  const std::string chunk(kChunkBytes, static_cast<char>(byte));
  for (size_t first = 0; first < ids_.size(); first += kBlocksPerStream) {
    const size_t n = std::min(kBlocksPerStream, ids_.size() - first);
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::WriteBlocksResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::WriteBlocksRequest>> w = stub_->WriteBlocks(&ctx, &resp);
    v1::WriteBlocksRequest msg;
    v1::WriteBlocksHeader* header = msg.mutable_header();
    header->mutable_block_ids()->Add(ids_.begin() + first, ids_.begin() + first + n);
    header->set_owner_epoch(epoch_);
    if (generations_.size() == ids_.size()) {
      header->mutable_block_generations()->Add(generations_.begin() + first,
                                               generations_.begin() + first + n);
    }
    bool open = w->Write(msg);
    for (uint64_t left = n * bytes_per_block_; open && left > 0;) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(left, kChunkBytes));
      msg.set_data(chunk.data(), take);
      open = w->Write(msg);
      left -= take;
    }
    w->WritesDone();
    if (absl::Status s = FromGrpcStatus(w->Finish()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status AgentBlocks::Free(std::span<const BlockId> ids) {
  if (ids.empty()) return absl::OkStatus();
  v1::FreeBlocksRequest req;
  req.mutable_block_ids()->Add(ids.begin(), ids.end());
  req.set_owner_epoch(epoch_);
  if (generations_.size() == ids_.size()) {  // an agent that answers generations
    for (BlockId id : ids) {
      auto it = std::find(ids_.begin(), ids_.end(), id);
      if (it == ids_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("block ", id, " is not one of this allocation's blocks"));
      }
      req.add_block_generations(generations_[it - ids_.begin()]);
    }
  }
  v1::FreeBlocksResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  return FromGrpcStatus(stub_->Free(&ctx, req, &resp));
}

absl::StatusOr<FetchedPages> FetchPlanned(v1::BlockAgent::Stub& dest, const NamespaceId& ns,
                                          const HashedPrompt& prompt, const FetchPlan& plan,
                                          absl::Duration timeout) {
  FetchedPages out;
  out.block_ids = plan.local_blocks;
  for (const FetchRun& run : plan.runs) {
    v1::FetchRequest req;
    NamespaceToProto(ns, req.mutable_namespace_());
    const size_t end = out.block_ids.size() + run.source_blocks.size();
    req.mutable_prompt()->set_page_hashes(EncodePageHashes(std::span(prompt.pages).first(end)));
    v1::HashScheme* scheme = req.mutable_prompt()->mutable_scheme();
    scheme->set_version(kPageHashVersion);
    scheme->set_page_size_tokens(prompt.page_size_tokens);
    scheme->set_key_fingerprint(prompt.key_fingerprint);
    req.mutable_local_block_ids()->Add(out.block_ids.begin(), out.block_ids.end());
    req.set_source_agent_id(run.source.agent_id);
    req.set_source_tier(TierToProto(run.source.tier));
    req.mutable_source_block_ids()->Add(run.source_blocks.begin(), run.source_blocks.end());
    v1::FetchResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    if (grpc::Status s = dest.Fetch(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
    out.block_ids.assign(resp.block_ids().begin(), resp.block_ids().end());
    out.fetched_pages += resp.fetched_pages();
    out.bytes += resp.bytes();
  }
  return out;
}

}  // namespace kvcm
