// BlockCommandIssuer: keeps the agents' block pools in step with the CacheIndex.
//
// As the index's event listener it queues, in the AgentCommandBook, the command each event
// of an agent's pool needs: FreeBlocks for the blocks of an evicted replica, DemoteBlocks
// for pages the index moved from the agent's GPU pool into its HOST pool. The completion of
// a DemoteBlocks reconciles the agent's answer with the index: the new HOST blocks are
// recorded (CacheIndex::AssignBlocks) and those the index no longer wants are freed with a
// follow-up FreeBlocks; a failed or malformed answer takes the pending HOST pages back out
// (CacheIndex::AbandonPending). A demotion that dies unacknowledged changes nothing: its
// epoch's pools were dropped, or the manager is stopping.
//
// Thread-safe (no state of its own). Lock order: CacheIndex's lock, then the book's; a
// completion runs with neither held and calls the index, then the book.
#ifndef KVCM_SERVER_CORE_BLOCK_COMMAND_ISSUER_H_
#define KVCM_SERVER_CORE_BLOCK_COMMAND_ISSUER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/agent_command.h"
#include "server/core/agent_command_book.h"
#include "server/core/cache_index.h"

namespace kvcm {

class BlockCommandIssuer {
 public:
  // `index` and `book` are not owned and must outlive the issuer and every command it
  // queued.
  BlockCommandIssuer(CacheIndex* index, AgentCommandBook* book);
  BlockCommandIssuer(const BlockCommandIssuer&) = delete;
  BlockCommandIssuer& operator=(const BlockCommandIssuer&) = delete;

  // A CacheEventListener (runs under the index's lock): queues the command `event` needs
  // for a pool of an agent the book knows; events of other pools need none.
  void OnEvent(const CacheEvent& event);

 private:
  // Where a DemoteBlocks' answer goes in the index.
  struct Demotion {
    std::string agent_id;
    uint64_t epoch = 0;
    NamespaceId ns;
    PoolKey pool;                // the HOST pool
    std::vector<PageHash> path;  // a prompt's leading pages, ending with the demoted ones
    uint32_t first_page = 0;     // first demoted page of `path`
  };

  void OnDemoteDone(const Demotion& demotion, const absl::StatusOr<AgentCommandAck>& result);

  CacheIndex* const index_;
  AgentCommandBook* const book_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_BLOCK_COMMAND_ISSUER_H_
