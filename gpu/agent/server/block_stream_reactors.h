// The BlockAgent stream reactors. WriteBlocksReactor reads the header, then writes each data
// chunk into its blocks as it arrives (BlockPool::WriteRange), so a stream holds at most one
// message. ReadBlocksReactor checks every block first, then streams the blocks' bytes in
// chunks of read_chunk_bytes (BlockPool::ReadRange), one write in flight at a time. Every
// chunk, both ways, checks the blocks' generations under the lock its copy holds: a block
// freed (and reallocated) mid-stream ends the stream ABORTED, touching none of the new
// allocation's bytes. Each stream holds a StreamLimiter slot of its caller until OnDone.
// What a stream does with its messages is a stage without gRPC (WriteBlocksStage,
// ReadBlocksStage), which the BlockAgent fuzzer runs as they are. Both reactors record their
// outcome through the RpcRunner when they finish and delete themselves in OnDone.
//
// Thread-safe: gRPC runs a reactor's callbacks one at a time.
#ifndef KVCM_GPU_AGENT_SERVER_BLOCK_STREAM_REACTORS_H_
#define KVCM_GPU_AGENT_SERVER_BLOCK_STREAM_REACTORS_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/page_hash.h"
#include "common/rpc_runner.h"
#include "common/token_table.h"
#include "common/types.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/stream_limiter.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

// The body of one WriteBlocks call for an authenticated caller, without gRPC: Take each
// message as it arrives, Apply when the client half-closes. The reactor and the BlockAgent
// fuzzer both run it. Not thread-safe (one call's messages arrive one at a time).
class WriteBlocksStage {
 public:
  // Writes into `pool` for `caller`. `options` and `pool` are not owned and must outlive the
  // stage.
  WriteBlocksStage(const AgentOptions* options, BlockPool* pool,
                   std::shared_ptr<const Principal> caller);

  // Checks one message. The first must be the header: its generations required of workers
  // (RequireGenerations) and its blocks authorized (AuthorizeBlocks, which binds their
  // generations) before anything else of it is looked at, so a refused caller learns nothing
  // of the blocks; then at most max_blocks_per_call blocks, each owned in its owner_epoch in
  // the bound generations. The others are data chunks of 1..max_message_bytes bytes,
  // together at most the header's blocks' bytes; INVALID_ARGUMENT (or the pool's error)
  // otherwise. A data chunk is written into its blocks at once, in the bound generations
  // (BlockPool::WriteRange: ABORTED for a block whose allocation ended).
  absl::Status Take(const v1::WriteBlocksRequest& msg);
  // At the end of the stream: INVALID_ARGUMENT unless every byte of the header's blocks
  // came; sets resp->bytes_written.
  absl::Status Apply(v1::WriteBlocksResponse* resp);

 private:
  const AgentOptions& options_;
  BlockPool& pool_;
  const std::shared_ptr<const Principal> caller_;
  bool have_header_ = false;
  std::vector<BlockId> ids_;
  std::vector<uint64_t> generations_;  // bound by authorization, parallel to ids_
  uint64_t owner_epoch_ = 0;
  uint64_t expected_bytes_ = 0;
  uint64_t written_bytes_ = 0;
};

// The optional page check of a read (ReadBlocksRequest, LocalCopy LOAD), decoded: the
// namespace and the page each block must hold.
struct OwnedPageCheck {
  NamespaceId ns;
  std::vector<PageHash> pages;  // parallel to the request's block ids

  PageCheck view() const { return PageCheck{.ns = &ns, .pages = pages}; }
};

// nullopt when neither a namespace nor page hashes were sent. INVALID_ARGUMENT naming the
// field for one without the other, a malformed namespace, or page_hashes not 16 bytes per
// block of `num_ids`.
absl::StatusOr<std::optional<OwnedPageCheck>> DecodePageCheck(bool has_namespace,
                                                              const v1::Namespace& ns,
                                                              const std::string& page_hashes,
                                                              size_t num_ids);

// The body of one ReadBlocks call for an authenticated caller, without gRPC: Open checks the
// request, Next fills its chunks in order. The reactor and the BlockAgent fuzzer both run it.
// Not thread-safe (one call's chunks are read one at a time).
class ReadBlocksStage {
 public:
  // Reads req's blocks from `pool` (the pool req.tier names; null when the agent has none)
  // for `caller`: generations, when given, required well-formed of workers
  // (RequireGenerations), every block authorized (AuthorizeBlocks, which binds their
  // generations), then INVALID_ARGUMENT for no pool, more than max_blocks_per_call blocks or
  // a bad page check (DecodePageCheck), the pool's error for a block not owned in
  // req.owner_epoch. `pool` is not owned and must outlive the stage.
  static absl::StatusOr<ReadBlocksStage> Open(const AgentOptions* options, const BlockPool* pool,
                                              const Principal& caller,
                                              const v1::ReadBlocksRequest& req);

  bool done() const { return sent_bytes_ == total_bytes_; }
  // Sets `chunk` to the next read_chunk_bytes (or fewer, the last) of the blocks' bytes, read
  // in the bound generations and, with a page check, from blocks still holding their pages:
  // ABORTED otherwise, nothing of the block copied. REQUIRES: !done().
  absl::Status Next(std::string& chunk);

 private:
  ReadBlocksStage(const BlockPool* pool, uint64_t chunk_bytes, const v1::ReadBlocksRequest& req,
                  std::vector<uint64_t> generations, std::optional<OwnedPageCheck> pages);

  const BlockPool* pool_;
  uint64_t chunk_bytes_;
  std::vector<BlockId> ids_;
  std::vector<uint64_t> generations_;  // bound by authorization, parallel to ids_
  uint64_t owner_epoch_;
  std::optional<OwnedPageCheck> pages_;  // the request's page check, if it sent one
  uint64_t total_bytes_;
  uint64_t sent_bytes_ = 0;
};

class WriteBlocksReactor final : public grpc::ServerReadReactor<v1::WriteBlocksRequest> {
 public:
  // Runs a WriteBlocksStage into `pool` for `caller` (or ends with its error, reading
  // nothing), holding a slot of `limiter` for the caller (or ending with
  // RESOURCE_EXHAUSTED). `options`, `pool`, `rpc` and `limiter` are not owned and
  // must outlive the call.
  WriteBlocksReactor(const AgentOptions* options, BlockPool* pool, RpcRunner<AgentRpc>* rpc,
                     grpc::CallbackServerContext* ctx, v1::WriteBlocksResponse* resp,
                     absl::StatusOr<std::shared_ptr<const Principal>> caller,
                     StreamLimiter* limiter);

  void OnReadDone(bool ok) override;
  void OnSendInitialMetadataDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // Records the outcome and finishes. May run OnDone inline: touches nothing afterwards.
  void End(const absl::Status& status);

  // Set once the caller holds a stream slot.
  std::optional<WriteBlocksStage> stage_;
  StreamLimiter::Slot slot_;
  RpcRunner<AgentRpc>* const rpc_;
  grpc::CallbackServerContext* const ctx_;
  v1::WriteBlocksResponse* const resp_;
  v1::WriteBlocksRequest msg_;
};

class ReadBlocksReactor final : public grpc::ServerWriteReactor<v1::ReadBlocksResponse> {
 public:
  // Streams the chunks of `stage`, or ends with its error (the caller's authentication, its
  // stream slot, or the stage's Open) before anything is read. `slot` is held until OnDone.
  // `rpc` is not owned and must outlive the call.
  ReadBlocksReactor(RpcRunner<AgentRpc>* rpc, absl::StatusOr<ReadBlocksStage> stage,
                    StreamLimiter::Slot slot = {});

  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // Fills the next chunk from as many blocks as it spans and starts writing it.
  void WriteNext();
  // Records the outcome and finishes. May run OnDone inline: touches nothing afterwards.
  void End(const absl::Status& status);

  RpcRunner<AgentRpc>* const rpc_;
  StreamLimiter::Slot slot_;
  std::optional<ReadBlocksStage> stage_;  // set unless the call ended at once
  v1::ReadBlocksResponse chunk_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_BLOCK_STREAM_REACTORS_H_
