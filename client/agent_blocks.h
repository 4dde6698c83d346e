// What a command-line worker asks of agents, the way an inference worker does: blocks it
// allocates for an Insert (kvcmctl insert), allocated to the namespace with the agent's epoch
// as owner (agent.proto, CommitBlocks) and handed back when the manager did not keep them;
// and the fetches that give an agent a replica of pages other agents hold (kvcmctl fetch).
#ifndef KVCM_CLIENT_AGENT_BLOCKS_H_
#define KVCM_CLIENT_AGENT_BLOCKS_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/fetch_plan.h"
#include "common/credentials.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

class AgentBlocks {
 public:
  // Connects to the BlockAgent at `address` over `channels` (a client's credentials and
  // token: Client::channels()) and allocates `count` blocks for `ns` with the agent's epoch.
  // The agent's errors as they are (RESOURCE_EXHAUSTED when it is full).
  static absl::StatusOr<AgentBlocks> Allocate(const ChannelFactory& channels,
                                              const std::string& address, const NamespaceId& ns,
                                              uint32_t count);

  // Writes every block of the allocation whole with `byte` (WriteBlocks streams of at most
  // 16 blocks): the agent commits a block only once all its bytes were written, and
  // kvcmctl has no KV of its own to write. The agent's errors as they are.
  absl::Status Fill(std::byte byte);

  // Frees `ids` (blocks of this allocation the manager did not index), naming the
  // generations Allocate returned (a worker's Free needs them); best effort.
  // INVALID_ARGUMENT for an id this allocation does not hold.
  absl::Status Free(std::span<const BlockId> ids);

  uint64_t epoch() const { return epoch_; }
  const std::vector<BlockId>& ids() const { return ids_; }
  // The generation of each block's allocation, parallel to ids().
  const std::vector<uint64_t>& generations() const { return generations_; }

 private:
  std::shared_ptr<v1::BlockAgent::Stub> stub_;
  uint64_t epoch_ = 0;
  uint64_t bytes_per_block_ = 0;
  std::vector<BlockId> ids_;
  std::vector<uint64_t> generations_;
};

// A prompt's page hashes with the scheme of the client that hashed them (RegisterModel
// gives the key's fingerprint and the page size).
struct HashedPrompt {
  std::vector<PageHash> pages;
  uint32_t page_size_tokens = 0;
  uint64_t key_fingerprint = 0;
};

struct FetchedPages {
  std::vector<BlockId> block_ids;  // the destination's block of each page [0, plan.end_page())
  uint32_t fetched_pages = 0;      // pulled from the sources
  uint64_t bytes = 0;              // moved
};

// Runs `plan` on the destination agent `dest`: one BlockAgent.Fetch per run, in order, each
// naming the destination's blocks of the pages before the run and the run's source agent
// (the destination looks its data address up at the manager); `timeout` bounds each call.
// REQUIRES: prompt.pages covers plan.end_page() pages. The first failing run's error
// (NOT_FOUND for a source the manager does not know); the runs before it stay done (their
// pages are indexed on the destination).
absl::StatusOr<FetchedPages> FetchPlanned(v1::BlockAgent::Stub& dest, const NamespaceId& ns,
                                          const HashedPrompt& prompt, const FetchPlan& plan,
                                          absl::Duration timeout = absl::Seconds(60));

}  // namespace kvcm

#endif  // KVCM_CLIENT_AGENT_BLOCKS_H_
