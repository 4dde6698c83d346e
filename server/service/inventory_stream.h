// The gRPC side of AgentControl.ReportInventory: one reactor per call reads an agent's
// inventory chunks, checks and converts each into an InventoryCollector, and when the agent
// closes the stream restores them into the index and answers the blocks to free.
#ifndef KVCM_SERVER_SERVICE_INVENTORY_STREAM_H_
#define KVCM_SERVER_SERVICE_INVENTORY_STREAM_H_

#include <grpcpp/grpcpp.h>

#include "common/rpc_runner.h"
#include "kvcm/v1/agent.pb.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/service/metrics.h"

namespace kvcm {

// Most blocks one InventoryChunk may carry.
inline constexpr int kMaxInventoryChunkBlocks = 16384;

// The reactor of one ReportInventory call, filling `reply`; it deletes itself when the call
// is done. The pointers are not owned and must outlive every call.
grpc::ServerReadReactor<v1::InventoryChunk>* OpenInventoryStream(CacheIndex* index,
                                                                 const AgentRegistry* agents,
                                                                 RpcRunner<Rpc>* rpc,
                                                                 v1::InventoryReply* reply);

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_INVENTORY_STREAM_H_
