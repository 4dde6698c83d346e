// AgentInserter: CacheManager.Insert, which puts pages in the index only as blocks their
// agent committed (ARCHITECTURE §2: whoever holds the KV is the truth).
//
// Into a pool of a registered agent, an insert is checked against the agent's geometry
// (block ids inside the pool, the namespace's page size equal to the block size), then sent
// to the agent as a CommitBlocks command. The agent's block ledger commits every block to
// its page or refuses the whole command; only on its ack does the index take the pages, and
// only blocks that command newly committed may add a page (CacheIndex InsertOptions). The
// blocks of pages the pool already held with another block, and every block the command
// committed when the index then refuses the insert, go back to their allocator with a
// ReleaseBlocks command; the insert answers after that command's ack, so the caller may free
// them as soon as it has the answer. An insert into a pool no agent registered (index-only)
// goes straight to the index.
//
// Thread-safe (no state of its own). Completions run on the thread that delivers the
// agent's ack, with no lock held; lock order as BlockCommandIssuer's.
#ifndef KVCM_SERVER_CORE_AGENT_INSERTER_H_
#define KVCM_SERVER_CORE_AGENT_INSERTER_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "server/core/agent_command_book.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"

namespace kvcm {

// One Insert, as the service decoded it.
struct InsertCommand {
  NamespaceId ns;
  std::vector<PageHash> pages;  // a prompt's leading pages
  PoolKey pool;
  std::vector<BlockId> block_ids;  // one per page, distinct, none kPendingBlock
  bool use_reservation = false;
  // InsertOptions::create_pool: may an Insert into an unknown pool create it.
  bool create_pool = true;
  // The agent epoch the blocks were allocated in; 0 when the caller does not say.
  uint64_t agent_epoch = 0;
  // Who inserts (AllocatorName of the caller): the agent commits only blocks it allocated.
  std::string committer;
};

using InsertDone = std::function<void(absl::StatusOr<InsertResult> result)>;

class AgentInserter {
 public:
  // Not owned; each must outlive the inserter and every insert it started.
  AgentInserter(CacheIndex* index, AgentCommandBook* book, const AgentRegistry* agents);
  AgentInserter(const AgentInserter&) = delete;
  AgentInserter& operator=(const AgentInserter&) = delete;

  // Runs `done` exactly once, inline or later on another thread, with the index's answer or
  // an error after which nothing changed: INVALID_ARGUMENT naming the field for a block past
  // the pool or a namespace whose page size is not the pool's block size; ABORTED when
  // agent_epoch is not the agent's epoch, or the epoch ends before the pages are indexed;
  // the agent's own error (FAILED_PRECONDITION naming block_ids[i]) when it refuses the
  // commit; the index's errors (FAILED_PRECONDITION for a block committed earlier to a page
  // the pool no longer holds, RESOURCE_EXHAUSTED, NOT_FOUND); UNAVAILABLE when the manager
  // stops first or the agent's command queue is full.
  void Insert(InsertCommand insert, InsertDone done);

 private:
  struct Pending;
  void OnCommitted(const Pending& pending, const absl::StatusOr<AgentCommandAck>& ack,
                   InsertDone done);

  CacheIndex* const index_;
  AgentCommandBook* const book_;
  const AgentRegistry* const agents_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_AGENT_INSERTER_H_
