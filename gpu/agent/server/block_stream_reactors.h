// The BlockAgent stream reactors. WriteBlocksReactor reads the header, then writes each data
// chunk into its blocks as it arrives (BlockPool::WriteRange), so a stream holds at most one
// message. ReadBlocksReactor checks every block first, then streams the blocks' bytes in
// chunks of read_chunk_bytes (BlockPool::ReadRange), one write in flight at a time. Every
// chunk, both ways, checks the blocks' generations under the lock its copy holds: a block
// freed (and reallocated) mid-stream ends the stream ABORTED, touching none of the new
// allocation's bytes. Each stream holds a StreamLimiter slot of its caller until OnDone.
// Both record their outcome through the RpcRunner when they finish and delete themselves in
// OnDone.
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

// The checks and writes of one WriteBlocks call, without gRPC: Take each message as it
// arrives, Apply when the client half-closes. Not thread-safe (one call's messages arrive
// one at a time).
class WriteBlocksStage {
 public:
  // Writes into `pool`. `options` and `pool` are not owned and must outlive the stage.
  WriteBlocksStage(const AgentOptions* options, BlockPool* pool);

  // Checks one message: the first must be the header (at most max_blocks_per_call blocks,
  // each owned in its owner_epoch, in `generations`: those authorization bound, parallel to
  // the header's ids, or empty: not checked), the others
  // data chunks of 1..max_message_bytes bytes, together at most the header's blocks' bytes;
  // INVALID_ARGUMENT (or the pool's error) otherwise. A data chunk is written into its
  // blocks at once (BlockPool::WriteRange: ABORTED for a block whose allocation ended).
  absl::Status Take(const v1::WriteBlocksRequest& msg, std::span<const uint64_t> generations = {});
  // At the end of the stream: INVALID_ARGUMENT unless every byte of the header's blocks
  // came; sets resp->bytes_written.
  absl::Status Apply(v1::WriteBlocksResponse* resp);

 private:
  const AgentOptions& options_;
  BlockPool& pool_;
  bool have_header_ = false;
  std::vector<BlockId> ids_;
  std::vector<uint64_t> generations_;  // parallel to ids_, or empty (not checked)
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

// The checks of a ReadBlocks request read from `pool` (null when the agent has no pool of
// req.tier): INVALID_ARGUMENT for no pool, more than max_blocks_per_call blocks or a bad page
// check (DecodePageCheck), the pool's error for a block not owned in req.owner_epoch.
absl::Status CheckReadBlocks(const AgentOptions& options, const BlockPool* pool,
                             const v1::ReadBlocksRequest& req);

// Fills `out` (its size is the chunk's) with the bytes at `offset` of the blocks `ids`
// read one after the other, each block holding its page of `pages` when given (ABORTED
// otherwise, nothing of it copied). REQUIRES: CheckReadBlocks passed, offset + out.size()
// within ids.size() blocks.
absl::Status ReadBlocksChunk(const BlockPool& pool, std::span<const BlockId> ids,
                             std::span<const uint64_t> generations, uint64_t owner_epoch,
                             uint64_t offset, std::string& out, const PageCheck* pages = nullptr);

class WriteBlocksReactor final : public grpc::ServerReadReactor<v1::WriteBlocksRequest> {
 public:
  // Writes into `pool` for `caller` (or ends with its error, reading nothing), once the
  // header's blocks pass AuthorizeBlocks, holding a slot of `limiter` for the caller (or
  // ending with RESOURCE_EXHAUSTED). `options`, `pool`, `rpc` and `limiter` are not owned and
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

  WriteBlocksStage stage_;
  StreamLimiter::Slot slot_;
  BlockPool* const pool_;
  std::shared_ptr<const Principal> caller_;
  bool authorized_ = false;
  RpcRunner<AgentRpc>* const rpc_;
  grpc::CallbackServerContext* const ctx_;
  v1::WriteBlocksResponse* const resp_;
  v1::WriteBlocksRequest msg_;
};

class ReadBlocksReactor final : public grpc::ServerWriteReactor<v1::ReadBlocksResponse> {
 public:
  // Reads from `pool`, the pool req->tier names, or null when the agent has no such pool (the
  // call then fails with INVALID_ARGUMENT). A failed `access` (the caller's authentication
  // or authorization, or its stream slot) ends the call with it before anything is read.
  // `slot` is held until OnDone. `options`, `pool` and `rpc` are not owned and must outlive
  // the call.
  // Every chunk is read in `generations` (parallel to req->block_ids, as authorization bound
  // them; empty: not checked).
  ReadBlocksReactor(const AgentOptions* options, BlockPool* pool, RpcRunner<AgentRpc>* rpc,
                    const v1::ReadBlocksRequest* req, const absl::Status& access = absl::OkStatus(),
                    StreamLimiter::Slot slot = {}, std::vector<uint64_t> generations = {});

  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // Fills the next chunk from as many blocks as it spans and starts writing it.
  void WriteNext();
  // Records the outcome and finishes. May run OnDone inline: touches nothing afterwards.
  void End(const absl::Status& status);

  BlockPool* const pool_;
  RpcRunner<AgentRpc>* const rpc_;
  const uint64_t chunk_bytes_;
  StreamLimiter::Slot slot_;
  const std::vector<BlockId> ids_;
  const std::vector<uint64_t> generations_;  // parallel to ids_, or empty (not checked)
  const uint64_t owner_epoch_;
  std::optional<OwnedPageCheck> pages_;  // the request's page check, if it sent one
  uint64_t total_bytes_ = 0;
  uint64_t sent_bytes_ = 0;
  v1::ReadBlocksResponse chunk_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_BLOCK_STREAM_REACTORS_H_
