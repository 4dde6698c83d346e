#include "server/core/agent_inserter.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvcm {

struct AgentInserter::Pending {
  InsertCommand insert;
  uint64_t epoch = 0;            // the agent's, when the commit was queued
  uint64_t pool_generation = 0;  // the index pool's, likewise
  absl::Time committed_at;       // the index's clock, likewise
};

namespace {

// What an Enqueue refusal means to the caller of Insert.
absl::Status QueueRefused(const PoolKey& pool, const absl::Status& status) {
  const std::string what = absl::StrCat("agent ", pool.agent_id, ": ", status.message());
  switch (status.code()) {
    case absl::StatusCode::kAborted:
      return absl::AbortedError(absl::StrCat(what, " (it re-registered; retry the insert)"));
    case absl::StatusCode::kResourceExhausted:
      return absl::UnavailableError(absl::StrCat(what, " (its command queue is full; retry)"));
    default:
      return absl::UnavailableError(what);
  }
}

}  // namespace

AgentInserter::AgentInserter(CacheIndex* index, AgentCommandBook* book, const AgentRegistry* agents)
    : index_(index), book_(book), agents_(agents) {}

void AgentInserter::Insert(InsertCommand insert, InsertDone done) {
  const std::optional<AgentPool> agent = agents_->FindPool(insert.pool);
  if (!agent.has_value()) {  // an index-only pool
    done(index_->Insert(
        insert.ns, insert.pages, insert.pool, insert.block_ids,
        {.use_reservation = insert.use_reservation, .create_pool = insert.create_pool}));
    return;
  }
  absl::StatusOr<RegisterModelResult> ns = index_->GetNamespace(insert.ns);
  if (!ns.ok()) {
    done(ns.status());
    return;
  }
  if (const uint64_t page_bytes = ns->spec.BytesPerPage(); page_bytes != agent->bytes_per_block) {
    done(absl::InvalidArgumentError(absl::StrCat(
        "namespace ", insert.ns.ToString(), " has pages of ", page_bytes, " bytes, but pool ",
        insert.pool.ToString(), " has blocks of ", agent->bytes_per_block,
        " bytes: a block holds one page of its pool's model")));
    return;
  }
  for (size_t i = 0; i < insert.block_ids.size(); ++i) {
    if (insert.block_ids[i] >= agent->num_blocks) {
      done(absl::InvalidArgumentError(absl::StrCat("block_ids[", i, "] = ", insert.block_ids[i],
                                                   " is past pool ", insert.pool.ToString(),
                                                   ", which has ", agent->num_blocks, " blocks")));
      return;
    }
  }
  if (insert.agent_epoch != 0 && insert.agent_epoch != agent->epoch) {
    done(absl::AbortedError(absl::StrCat("agent_epoch ", insert.agent_epoch, " is not agent ",
                                         insert.pool.agent_id, "'s epoch ", agent->epoch,
                                         ": the agent restarted and the blocks died with it")));
    return;
  }
  absl::StatusOr<uint64_t> generation = index_->PoolGeneration(insert.pool);
  if (!generation.ok()) {
    done(generation.status());
    return;
  }

  auto pending = std::make_shared<Pending>();
  pending->epoch = agent->epoch;
  pending->pool_generation = *generation;
  // The pages' age counts from here, in the index and in the agent's ledger alike.
  pending->committed_at = index_->Now();
  CommitBlocksCommand commit{
      .tier = insert.pool.tier,
      .ns = insert.ns,
      .spec = ns->spec,
      .block_ids = insert.block_ids,
      .pages = insert.pages,
      .committed_unix_ms = absl::ToUnixMillis(pending->committed_at),
      .max_page_age_s = static_cast<uint32_t>(absl::ToInt64Seconds(ns->registered_max_page_age)),
      .committer = insert.committer};
  pending->insert = std::move(insert);
  // `done` is moved into the completion only once the command is queued: a refused Enqueue
  // never runs the completion, and `done` must still be called here.
  auto done_box = std::make_shared<InsertDone>(std::move(done));
  absl::StatusOr<uint64_t> queued =
      book_->Enqueue(pending->insert.pool.agent_id, pending->epoch, std::move(commit),
                     [this, pending, done_box](const absl::StatusOr<AgentCommandAck>& ack) {
                       OnCommitted(*pending, ack, std::move(*done_box));
                     });
  if (!queued.ok()) (*done_box)(QueueRefused(pending->insert.pool, queued.status()));
}

void AgentInserter::OnCommitted(const Pending& p, const absl::StatusOr<AgentCommandAck>& ack,
                                InsertDone done) {
  const InsertCommand& insert = p.insert;
  if (!ack.ok()) {  // the epoch ended (its blocks with it) or the manager is stopping
    done(absl::Status(ack.status().code(),
                      absl::StrCat("agent ", insert.pool.agent_id, " did not commit the blocks: ",
                                   ack.status().message(), "; nothing was indexed")));
    return;
  }
  if (!ack->status.ok()) {
    done(absl::Status(ack->status.code(),
                      absl::StrCat("agent ", insert.pool.agent_id, " refused the blocks: ",
                                   ack->status.message(), "; nothing was indexed")));
    return;
  }

  // Which blocks this commit took from allocated to committed. An ack naming a block the
  // insert did not list is the agent's bug: those are left alone.
  const absl::flat_hash_set<BlockId> newly(ack->block_ids.begin(), ack->block_ids.end());
  std::vector<bool> newly_committed(insert.block_ids.size());
  for (size_t i = 0; i < insert.block_ids.size(); ++i) {
    newly_committed[i] = newly.contains(insert.block_ids[i]);
  }
  absl::StatusOr<InsertResult> result =
      index_->Insert(insert.ns, insert.pages, insert.pool, insert.block_ids,
                     {.use_reservation = insert.use_reservation,
                      .newly_committed = newly_committed,
                      .pool_generation = p.pool_generation,
                      .committed_at = p.committed_at});

  // Blocks to hand back to their allocator: all this commit took if the index refused, else
  // those of pages the pool already held with another block.
  ReleaseBlocksCommand release{.tier = insert.pool.tier};
  for (size_t i = 0; i < insert.block_ids.size(); ++i) {
    if (!newly_committed[i]) continue;
    const bool duplicate = result.ok() && i < result->already_present_pages &&
                           result->existing_block_ids[i] != insert.block_ids[i];
    if (!result.ok() || duplicate) release.block_ids.push_back(insert.block_ids[i]);
  }
  if (release.block_ids.empty()) {
    done(std::move(result));
    return;
  }
  auto result_box = std::make_shared<absl::StatusOr<InsertResult>>(std::move(result));
  auto done_box = std::make_shared<InsertDone>(std::move(done));
  // Refused only when the epoch ended (its blocks are gone) or the manager is stopping; a
  // failed release leaves the blocks committed until the epoch ends. Either way the index
  // never refers to them, and the answer stands.
  absl::StatusOr<uint64_t> queued =
      book_->Enqueue(insert.pool.agent_id, p.epoch, std::move(release),
                     [result_box, done_box](const absl::StatusOr<AgentCommandAck>& /*ack*/) {
                       (*done_box)(std::move(*result_box));
                     });
  if (!queued.ok()) (*done_box)(std::move(*result_box));
}

}  // namespace kvcm
