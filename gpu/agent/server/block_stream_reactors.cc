#include "gpu/agent/server/block_stream_reactors.h"

#include <algorithm>
#include <optional>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu/agent/server/block_agent_access.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

// Bytes of one page hash on the wire (Prompt.page_hashes encoding).
constexpr size_t kPageHashBytes = 16;

}  // namespace

WriteBlocksReactor::WriteBlocksReactor(const AgentOptions* options, BlockPool* pool,
                                       RpcRunner<AgentRpc>* rpc, grpc::CallbackServerContext* ctx,
                                       v1::WriteBlocksResponse* resp,
                                       absl::StatusOr<std::shared_ptr<const Principal>> caller,
                                       StreamLimiter* limiter)
    : rpc_(rpc), ctx_(ctx), resp_(resp) {
  if (!caller.ok()) {
    End(caller.status());
    return;
  }
  absl::StatusOr<StreamLimiter::Slot> slot = limiter->Acquire((*caller)->name);
  if (!slot.ok()) {
    End(slot.status());
    return;
  }
  slot_ = *std::move(slot);
  stage_.emplace(options, pool, *std::move(caller));
  StartRead(&msg_);
}

void WriteBlocksReactor::OnReadDone(bool ok) {
  if (!ok) {
    if (ctx_->IsCancelled()) {
      End(absl::CancelledError("WriteBlocks cancelled"));
      return;
    }
    // The client half-closed, or gRPC refused its next message (e.g. over the size limit)
    // and failed the call without marking it cancelled. Sending the initial metadata
    // tells the two apart, as it fails on a failed call; only a live call is applied.
    StartSendInitialMetadata();
    return;
  }
  if (absl::Status s = stage_->Take(msg_); !s.ok()) {
    End(s);
    return;
  }
  StartRead(&msg_);
}

void WriteBlocksReactor::OnSendInitialMetadataDone(bool ok) {
  End(ok ? stage_->Apply(resp_) : absl::CancelledError("WriteBlocks: the call failed"));
}

WriteBlocksStage::WriteBlocksStage(const AgentOptions* options, BlockPool* pool,
                                   std::shared_ptr<const Principal> caller)
    : options_(*options), pool_(*pool), caller_(std::move(caller)) {}

absl::Status WriteBlocksStage::Take(const v1::WriteBlocksRequest& msg) {
  if (!have_header_) {
    if (!msg.has_header()) {
      return absl::InvalidArgumentError("header must be the stream's first message");
    }
    const v1::WriteBlocksHeader& h = msg.header();
    const std::span<const BlockId> ids(h.block_ids().data(), h.block_ids_size());
    const std::span<const uint64_t> gens(h.block_generations().data(), h.block_generations_size());
    // Before the header is checked: a refused call learns nothing of the blocks. Every chunk
    // is written in the generations bound here.
    KVCM_RETURN_IF_ERROR(
        RequireGenerations(*caller_, ids.size(), gens, "header.block_generations"));
    KVCM_RETURN_IF_ERROR(
        AuthorizeBlocks(*caller_, &pool_, ids, "write blocks", gens, &generations_));
    if (h.block_ids_size() > static_cast<int>(options_.max_blocks_per_call)) {
      return absl::InvalidArgumentError(absl::StrCat("header.block_ids must list at most ",
                                                     options_.max_blocks_per_call, " blocks"));
    }
    ids_.assign(ids.begin(), ids.end());
    owner_epoch_ = h.owner_epoch();
    KVCM_RETURN_IF_ERROR(pool_.CheckOwned(ids_, owner_epoch_, "header.block_ids", generations_));
    expected_bytes_ = ids_.size() * pool_.geometry().bytes_per_block();
    have_header_ = true;
    return absl::OkStatus();
  }
  if (msg.has_header()) return absl::InvalidArgumentError("header sent twice");
  const std::string& data = msg.data();
  if (data.empty() || data.size() > options_.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data chunk must be 1..", options_.max_message_bytes, " bytes, got ", data.size()));
  }
  if (data.size() > expected_bytes_ - written_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("data exceeds ", ids_.size(), " blocks x ",
                                                   pool_.geometry().bytes_per_block(), " = ",
                                                   expected_bytes_, " bytes"));
  }
  KVCM_RETURN_IF_ERROR(pool_.WriteRange(ids_, generations_, owner_epoch_, written_bytes_,
                                        std::as_bytes(std::span<const char>(data)),
                                        "header.block_ids"));
  written_bytes_ += data.size();
  return absl::OkStatus();
}

absl::Status WriteBlocksStage::Apply(v1::WriteBlocksResponse* resp) {
  if (!have_header_) return absl::InvalidArgumentError("header is missing (empty stream)");
  if (written_bytes_ != expected_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("data: got ", written_bytes_, " bytes, expected ", ids_.size(), " blocks x ",
                     pool_.geometry().bytes_per_block(), " = ", expected_bytes_));
  }
  resp->set_bytes_written(written_bytes_);
  return absl::OkStatus();
}

void WriteBlocksReactor::End(const absl::Status& status) {
  Finish(rpc_->StreamEnd(AgentRpc::kWriteBlocks, status));
}

absl::StatusOr<std::optional<OwnedPageCheck>> DecodePageCheck(bool has_namespace,
                                                              const v1::Namespace& ns,
                                                              const std::string& page_hashes,
                                                              size_t num_ids) {
  if (!has_namespace && page_hashes.empty()) return std::nullopt;
  if (!has_namespace) {
    return absl::InvalidArgumentError("namespace is required with page_hashes");
  }
  if (page_hashes.size() != num_ids * kPageHashBytes) {
    return absl::InvalidArgumentError(absl::StrCat("page_hashes is ", page_hashes.size(),
                                                   " bytes; expected ", kPageHashBytes, " x ",
                                                   num_ids, " blocks"));
  }
  KVCM_ASSIGN_OR_RETURN(NamespaceId id, NamespaceFromProto(&ns, "namespace"));
  return OwnedPageCheck{.ns = std::move(id), .pages = DecodePageHashes(page_hashes)};
}

absl::StatusOr<ReadBlocksStage> ReadBlocksStage::Open(const AgentOptions* options,
                                                      const BlockPool* pool,
                                                      const Principal& caller,
                                                      const v1::ReadBlocksRequest& req) {
  const std::span<const BlockId> ids(req.block_ids().data(), req.block_ids_size());
  // Optional: a Match's committed blocks come without generations. Bound either way.
  const std::span<const uint64_t> gens(req.block_generations().data(),
                                       req.block_generations_size());
  if (!gens.empty()) {
    KVCM_RETURN_IF_ERROR(RequireGenerations(caller, ids.size(), gens, "block_generations"));
  }
  std::vector<uint64_t> bound;
  KVCM_RETURN_IF_ERROR(AuthorizeBlocks(caller, pool, ids, "read blocks", gens, &bound));
  const uint32_t max_blocks = options->max_blocks_per_call;
  if (pool == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier ", static_cast<int>(req.tier()), " is not a pool of this agent"));
  }
  if (ids.size() > max_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_ids must list at most ", max_blocks, " blocks"));
  }
  KVCM_ASSIGN_OR_RETURN(
      std::optional<OwnedPageCheck> pages,
      DecodePageCheck(req.has_namespace_(), req.namespace_(), req.page_hashes(), ids.size()));
  KVCM_RETURN_IF_ERROR(pool->CheckOwned(ids, req.owner_epoch(), "block_ids", gens));
  return ReadBlocksStage(pool, options->read_chunk_bytes, req, std::move(bound), std::move(pages));
}

ReadBlocksStage::ReadBlocksStage(const BlockPool* pool, uint64_t chunk_bytes,
                                 const v1::ReadBlocksRequest& req,
                                 std::vector<uint64_t> generations,
                                 std::optional<OwnedPageCheck> pages)
    : pool_(pool),
      chunk_bytes_(chunk_bytes),
      ids_(req.block_ids().begin(), req.block_ids().end()),
      generations_(std::move(generations)),
      owner_epoch_(req.owner_epoch()),
      pages_(std::move(pages)),
      total_bytes_(ids_.size() * pool->geometry().bytes_per_block()) {}

absl::Status ReadBlocksStage::Next(std::string& chunk) {
  chunk.resize(std::min(chunk_bytes_, total_bytes_ - sent_bytes_));
  const std::optional<PageCheck> pages =
      pages_.has_value() ? std::optional<PageCheck>(pages_->view()) : std::nullopt;
  KVCM_RETURN_IF_ERROR(pool_->ReadRange(ids_, generations_, owner_epoch_, sent_bytes_,
                                        std::as_writable_bytes(std::span<char>(chunk)), "block_ids",
                                        pages ? &*pages : nullptr));
  sent_bytes_ += chunk.size();
  return absl::OkStatus();
}

ReadBlocksReactor::ReadBlocksReactor(RpcRunner<AgentRpc>* rpc,
                                     absl::StatusOr<ReadBlocksStage> stage,
                                     StreamLimiter::Slot slot)
    : rpc_(rpc), slot_(std::move(slot)) {
  if (!stage.ok()) {
    End(stage.status());
    return;
  }
  stage_.emplace(*std::move(stage));
  WriteNext();
}

void ReadBlocksReactor::OnWriteDone(bool ok) {
  if (!ok) {
    End(absl::CancelledError("ReadBlocks: the stream broke"));
    return;
  }
  WriteNext();
}

void ReadBlocksReactor::WriteNext() {
  if (stage_->done()) {
    End(absl::OkStatus());
    return;
  }
  if (absl::Status s = stage_->Next(*chunk_.mutable_data()); !s.ok()) {
    End(s);
    return;
  }
  StartWrite(&chunk_);
}

void ReadBlocksReactor::End(const absl::Status& status) {
  Finish(rpc_->StreamEnd(AgentRpc::kReadBlocks, status));
}

}  // namespace kvcm
