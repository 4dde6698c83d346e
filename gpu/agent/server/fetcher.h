// Fetcher: BlockAgent.Fetch's work — a new replica of a prompt's pages in this agent's pool,
// pulled from another agent's pool. It looks the source agent's data address up at the
// manager (PeerLookup), allocates blocks for the namespace (through the RoomMaker, so a
// full pool evicts for the replica), pulls the bytes through the
// Transport, then inserts the prompt into this pool at the manager, which
// commits the blocks here (CommitBlocks) before indexing them. Blocks of a failed pull or
// insert, and blocks of pages the pool already held, go back to the free list: a fetch
// leaks nothing whatever fails, on either side.
//
// Thread-safe: Fetch may run concurrently; each fetch's completion runs on a transport
// thread or the lookup's gRPC thread.
#ifndef KVCM_GPU_AGENT_SERVER_FETCHER_H_
#define KVCM_GPU_AGENT_SERVER_FETCHER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "gpu/agent/control/peer_lookup.h"
#include "gpu/agent/control/room_maker.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/transport/transport.h"
#include "kvcm/v1/agent.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"

namespace kvcm {

struct FetchResult {
  std::vector<BlockId> block_ids;  // this pool's block of every page, as indexed
  uint32_t fetched_pages = 0;
  uint64_t bytes = 0;
};

using FetchDone = std::function<void(absl::StatusOr<FetchResult> result)>;

class Fetcher {
 public:
  // None of the pointers is owned; all must outlive the fetcher and its fetches.
  // `lookup` resolves FetchRequest.source_agent_id to the address the transport dials.
  Fetcher(std::string agent_id, Tier main_tier, AgentPools pools, const AgentEpoch* epoch,
          Transport* transport, PeerLookup lookup, v1::CacheManager::Stub* manager,
          AgentMetrics* metrics, RoomMaker* room_maker = nullptr);

  // Runs `req` (BlockAgent.Fetch); `done` runs exactly once, inline for a malformed request,
  // else on the lookup's or a transport thread. Errors as documented on BlockAgent.Fetch;
  // whatever keeps the source from answering (refused, silent, gone mid-transfer) is one
  // UNAVAILABLE naming source_agent_id, the details in this agent's log.
  void Fetch(const v1::FetchRequest& req, FetchDone done);

 private:
  struct Job;
  void OnResolved(std::shared_ptr<Job> job, absl::StatusOr<std::string> address, FetchDone done);
  // The blocks are allocated (job->fetched): pulls into them from `address`.
  void OnAllocated(std::shared_ptr<Job> job, std::string address, FetchDone done);
  void OnPulled(const Job& job, absl::StatusOr<TransferStats> pulled, FetchDone done);
  // Frees `ids` of their allocations `generations` (parallel), logging a failure.
  void FreeQuietly(BlockPool* pool, const std::vector<BlockId>& ids, uint64_t epoch,
                   const std::vector<uint64_t>& generations);

  const std::string agent_id_;
  const Tier main_tier_;
  const AgentPools pools_;
  const AgentEpoch* const epoch_;
  Transport* const transport_;
  const PeerLookup lookup_;
  v1::CacheManager::Stub* const manager_;
  AgentMetrics* const metrics_;
  RoomMaker* const room_maker_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_FETCHER_H_
