#include "server/core/block_command_issuer.h"

#include <utility>

namespace kvcm {

BlockCommandIssuer::BlockCommandIssuer(CacheIndex* index, AgentCommandBook* book)
    : index_(index), book_(book) {}

void BlockCommandIssuer::OnEvent(const CacheEvent& event) {
  if (event.kind == CacheEvent::Kind::kRemoved) {
    FreeBlocksCommand free{.tier = event.pool.tier};
    for (BlockId id : event.block_ids) {
      if (id != kPendingBlock) free.block_ids.push_back(id);  // never reported: nothing to free
    }
    if (free.block_ids.empty()) return;
    // Refused: a pool no agent registered (e.g. filled by Insert alone), or a full queue
    // (counted by the book).
    (void)book_->Enqueue(event.pool.agent_id, AgentCommandBook::kCurrentEpoch, std::move(free),
                         nullptr);
  } else if (event.kind == CacheEvent::Kind::kStored && event.demoted_from.has_value()) {
    const std::string& agent_id = event.demoted_from->agent_id;
    const uint64_t epoch = book_->epoch(agent_id);
    if (epoch == 0) return;
    Demotion demotion{.agent_id = agent_id,
                      .epoch = epoch,
                      .ns = event.ns,
                      .pool = event.pool,
                      .path = event.prefix,
                      .first_page = static_cast<uint32_t>(event.prefix.size())};
    demotion.path.insert(demotion.path.end(), event.pages.begin(), event.pages.end());
    (void)book_->Enqueue(
        agent_id, epoch, DemoteBlocksCommand{.source_block_ids = event.source_block_ids},
        [this, demotion = std::move(demotion)](const absl::StatusOr<AgentCommandAck>& result) {
          OnDemoteDone(demotion, result);
        });
  }
}

void BlockCommandIssuer::OnDemoteDone(const Demotion& d,
                                      const absl::StatusOr<AgentCommandAck>& result) {
  if (!result.ok()) return;  // the epoch ended (its pools were dropped) or the book closed
  if (!result->status.ok()) {
    // The agent holds no copy: take the pending HOST pages back out of the index.
    (void)index_->AbandonPending(d.ns, d.path, d.first_page, d.pool);
    return;
  }
  const std::vector<BlockId>& blocks = result->block_ids;
  absl::StatusOr<std::vector<BlockId>> unassigned =
      index_->AssignBlocks(d.ns, d.path, d.first_page, d.pool, blocks);
  if (!unassigned.ok()) {
    // A malformed answer (e.g. the wrong number of blocks): the index cannot use it, so the
    // pages are undone as for a failed copy, and the blocks named are freed below.
    (void)index_->AbandonPending(d.ns, d.path, d.first_page, d.pool);
  }
  std::vector<BlockId> to_free = unassigned.ok() ? *std::move(unassigned) : blocks;
  if (to_free.empty()) return;
  // Refused when the epoch has ended: its blocks died with it.
  (void)book_->Enqueue(d.agent_id, d.epoch,
                       FreeBlocksCommand{.tier = d.pool.tier, .block_ids = std::move(to_free)},
                       nullptr);
}

}  // namespace kvcm
