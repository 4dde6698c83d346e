// The gRPC side of AgentControl.ReportInventory: one reactor per call reads an agent's
// inventory chunks, checks and converts each into an InventoryCollector, and when the agent
// closes the stream restores them into the index and answers the blocks to free.
#ifndef KVCM_SERVER_SERVICE_INVENTORY_STREAM_H_
#define KVCM_SERVER_SERVICE_INVENTORY_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>

#include "common/rpc_runner.h"
#include "common/token_table.h"
#include "kvcm/v1/agent.pb.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/core/inventory_restore.h"
#include "server/service/metrics.h"

namespace kvcm {

// Most blocks one InventoryChunk may carry.
inline constexpr int kMaxInventoryChunkBlocks = 16384;

// One ReportInventory call without gRPC: Take checks each chunk as it arrives and collects
// it, Restore indexes what was collected when the agent closes the stream. The reactor only
// moves the chunks in. Not thread-safe (one call's chunks arrive one at a time).
class InventoryReceiver {
 public:
  // Not owned; both must outlive the receiver. `caller` sent the chunks: the first chunk's
  // agent_id must be one it may act as (AuthorizeAgent).
  InventoryReceiver(CacheIndex* index, const AgentRegistry* agents,
                    std::shared_ptr<const Principal> caller);

  // The first chunk names the agent, which must be live in that epoch (its error otherwise,
  // ABORTED when it has no pool); every chunk must repeat its agent_id and epoch and carry
  // at most kMaxInventoryChunkBlocks blocks with 16 bytes of page_hashes and of
  // parent_hashes each, a valid namespace and spec (INVALID_ARGUMENT naming the field).
  absl::Status Take(const v1::InventoryChunk& chunk);
  // Indexes every chunk taken (nothing when none was) and fills `reply`.
  absl::Status Restore(v1::InventoryReply* reply);

 private:
  absl::Status Begin(const v1::InventoryChunk& chunk);

  CacheIndex* const index_;
  const AgentRegistry* const agents_;
  const std::shared_ptr<const Principal> caller_;
  std::string agent_id_;
  uint64_t epoch_ = 0;
  std::optional<InventoryCollector> collector_;
};

// The reactor of one ReportInventory call of `caller`, filling `reply`; it deletes itself
// when the call is done. A caller that did not authenticate is refused before any chunk is
// read. The pointers are not owned and must outlive every call.
grpc::ServerReadReactor<v1::InventoryChunk>* OpenInventoryStream(
    CacheIndex* index, const AgentRegistry* agents, RpcRunner<Rpc>* rpc,
    absl::StatusOr<std::shared_ptr<const Principal>> caller, v1::InventoryReply* reply);

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_INVENTORY_STREAM_H_
