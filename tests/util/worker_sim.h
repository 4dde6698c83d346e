// WorkerSim: what an inference engine's worker does per request, against a real kvcm cluster
// (ARCHITECTURE §2), for the multi-process tests. For each prompt: Route among the agents
// (prefill-saved, each candidate with the simulator's queue for it) with a pin for the chosen
// one; fetch the pages Route says are worth moving from the replicas its match lists
// (BlockAgent.Fetch); "prefill" the rest: allocate blocks for the namespace with the agent's
// epoch, write PageBytes of each page, Insert with agent_epoch; then Match(pin) the whole
// prompt on the agent for the "decode", and Release both pins.
//
// Every block of page p holds PageBytes(p), so any replica of any page can be checked.
// Not thread-safe: one request at a time.
#ifndef KVCM_TESTS_UTIL_WORKER_SIM_H_
#define KVCM_TESTS_UTIL_WORKER_SIM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm::testing {

class WorkerSim {
 public:
  struct AgentInfo {
    std::string id;
    std::string block_agent_address;
  };

  // `client` must outlive the simulator. Registers `ns` with `spec` (the client then hashes
  // locally) and reads each agent's epoch and block size; errors as those calls'.
  static absl::StatusOr<std::unique_ptr<WorkerSim>> Create(Client* client, NamespaceId ns,
                                                           const ModelSpec& spec,
                                                           std::vector<AgentInfo> agents);

  // How one request was served.
  struct Served {
    std::string agent;
    uint32_t cached_pages = 0;       // already on the agent
    uint32_t fetched_pages = 0;      // pulled from other agents
    uint32_t computed_pages = 0;     // written and inserted by the simulator
    std::vector<BlockId> block_ids;  // the agent's block of every whole page of the prompt
  };

  // Serves `tokens` on the agent Route ranks first among `candidates`.
  absl::StatusOr<Served> Serve(std::span<const int32_t> tokens,
                               std::vector<RouteParams::Candidate> candidates);
  // Serves `tokens` among every agent, each with the simulator's queue: the tokens it was
  // given to prefill (fetched and computed), decaying by a quarter per request.
  absl::StatusOr<Served> Serve(std::span<const int32_t> tokens);

  // The bytes of the block holding `page`: bf16 values of magnitude in [2^-7, 1) with random
  // signs, from a generator seeded by the hash (finite for the attention kernels).
  std::string PageBytes(const PageHash& page) const;
  // What any replica of pages [first, first + n) of `pages` must hold.
  std::string ExpectedBytes(std::span<const PageHash> pages, size_t first, size_t n) const;
  // What `agent` holds in `blocks` (ReadBlocks in its epoch, max_blocks_per_call a call).
  absl::StatusOr<std::string> ReadBlocks(const std::string& agent, std::span<const BlockId> blocks);
  uint64_t bytes_per_block() const { return bytes_per_block_; }
  uint64_t epoch(const std::string& agent) const { return agents_.at(agent).epoch; }
  v1::BlockAgent::Stub& stub(const std::string& agent) { return *agents_.at(agent).stub; }

 private:
  struct Agent {
    AgentInfo info;
    std::unique_ptr<v1::BlockAgent::Stub> stub;
    uint64_t epoch = 0;
    uint64_t queued_tokens = 0;
  };

  WorkerSim(Client* client, NamespaceId ns) : client_(client), ns_(std::move(ns)) {}
  // Allocates, writes and inserts pages [first, end) of `pages` on `agent`, whose blocks of
  // pages [0, first) are `held`; returns the blocks of all `end` pages.
  absl::StatusOr<std::vector<BlockId>> Prefill(Agent& agent, std::span<const PageHash> pages,
                                               std::vector<BlockId> held);

  Client* const client_;
  const NamespaceId ns_;
  uint32_t page_size_tokens_ = 0;
  uint64_t key_fingerprint_ = 0;
  uint64_t bytes_per_block_ = 0;
  uint32_t max_blocks_per_call_ = 64;  // the agent's default; WriteBlocks in batches of it
  std::map<std::string, Agent> agents_;
  std::vector<std::string> order_;  // agent ids as given to Create: the candidate order
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_WORKER_SIM_H_
