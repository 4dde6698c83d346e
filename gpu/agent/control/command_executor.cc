#include "gpu/agent/control/command_executor.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/page_hash.h"
#include "common/status_macros.h"
#include "gpu/agent/control/agent_proto.h"
#include "gpu/agent/pool/agent_state.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

constexpr size_t kPageHashBytes = 16;

std::vector<BlockId> Ids(const google::protobuf::RepeatedField<uint32_t>& ids) {
  return std::vector<BlockId>(ids.begin(), ids.end());
}

}  // namespace

CommandExecutor::CommandExecutor(BlockPool* pool, Tier tier, BlockPool* host_pool,
                                 NamespaceSpecs* specs)
    : pool_(pool),
      tier_(tier),
      host_pool_(host_pool),
      specs_(specs != nullptr ? specs : &own_specs_) {}

void CommandExecutor::Reset(uint64_t epoch) {
  epoch_ = epoch;
  last_sequence_ = 0;
  recent_.clear();
}

v1::AgentCommandAck CommandExecutor::Execute(const v1::AgentCommand& command) {
  if (const uint64_t incarnation = command.manager_incarnation();
      incarnation != 0 && incarnation != manager_incarnation_) {
    // Another manager process numbers from 1 again in the same epoch: its sequences are
    // not the old ones, and the old one's unconfirmed acks will never be asked for.
    manager_incarnation_ = incarnation;
    last_sequence_ = 0;
    recent_.clear();
  }
  while (!recent_.empty() && recent_.front().sequence() <= command.acked_through()) {
    recent_.pop_front();
  }
  if (command.sequence() <= last_sequence_) {
    for (const v1::AgentCommandAck& ack : recent_) {
      if (ack.sequence() == command.sequence()) return ack;
    }
    v1::AgentCommandAck ack;
    ack.set_sequence(command.sequence());
    ack.set_code(static_cast<int32_t>(absl::StatusCode::kAborted));
    ack.set_message(absl::StrCat("sequence ", command.sequence(),
                                 " ran before and its ack was "
                                 "confirmed; not running it again"));
    return ack;
  }

  absl::Status status;
  v1::AgentCommandAck ack;
  ack.set_sequence(command.sequence());
  switch (command.command_case()) {
    case v1::AgentCommand::kCommit: {
      absl::StatusOr<std::vector<BlockId>> blocks = Commit(command.commit());
      status = blocks.status();
      if (blocks.ok()) ack.mutable_block_ids()->Add(blocks->begin(), blocks->end());
      break;
    }
    case v1::AgentCommand::kRelease:
      status = Release(command.release());
      break;
    case v1::AgentCommand::kFree:
      status = Free(command.free());
      break;
    case v1::AgentCommand::kDemote: {
      absl::StatusOr<std::vector<BlockId>> blocks = Demote(command.demote());
      status = blocks.status();
      if (blocks.ok()) ack.mutable_block_ids()->Add(blocks->begin(), blocks->end());
      break;
    }
    default:
      status = absl::UnimplementedError(
          absl::StrCat("unknown command ", static_cast<int>(command.command_case())));
  }
  ack.set_code(static_cast<int32_t>(status.code()));
  ack.set_message(std::string(status.message()));
  last_sequence_ = command.sequence();
  recent_.push_back(ack);
  return ack;
}

absl::StatusOr<BlockPool*> CommandExecutor::PoolOf(v1::Tier tier, absl::string_view field) const {
  BlockPool* pool = AgentPools{.main = pool_, .host = host_pool_}.ForWireTier(tier_, tier);
  if (pool == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", static_cast<int>(tier), " is not a pool of this agent"));
  }
  return pool;
}

absl::StatusOr<std::vector<BlockId>> CommandExecutor::Commit(const v1::CommitBlocks& commit) {
  KVCM_ASSIGN_OR_RETURN(BlockPool * pool, PoolOf(commit.tier(), "commit.tier"));
  if (!commit.has_namespace_()) {
    return absl::InvalidArgumentError("commit.namespace is required");
  }
  KVCM_ASSIGN_OR_RETURN(NamespaceId ns,
                        NamespaceFromProto(&commit.namespace_(), "commit.namespace"));
  if (!commit.has_spec()) return absl::InvalidArgumentError("commit.spec is required");
  KVCM_ASSIGN_OR_RETURN(ModelSpec spec, ModelSpecFromProto(&commit.spec(), "commit.spec"));
  if (const uint64_t bpb = pool->geometry().bytes_per_block(); spec.BytesPerPage() != bpb) {
    return absl::InvalidArgumentError(absl::StrCat("commit.spec has pages of ", spec.BytesPerPage(),
                                                   " bytes; the pool's blocks are ", bpb));
  }
  const std::vector<BlockId> ids = Ids(commit.block_ids());
  if (commit.page_hashes().size() != ids.size() * kPageHashBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "commit.page_hashes is ", commit.page_hashes().size(),
        " bytes; 16 per block of block_ids (", ids.size(), ") is ", ids.size() * kPageHashBytes));
  }
  const std::string& first_parent = commit.first_parent_hash();
  if (!first_parent.empty() && first_parent.size() != kPageHashBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("commit.first_parent_hash must be 0 or 16 bytes, got ", first_parent.size()));
  }
  const std::vector<PageHash> pages = DecodePageHashes(commit.page_hashes());
  std::vector<CommitEntry> entries(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    entries[i].block = ids[i];
    entries[i].page = pages[i];
    if (i > 0) {
      entries[i].parent = pages[i - 1];
    } else if (!first_parent.empty()) {
      entries[i].parent = DecodePageHashes(first_parent)[0];
    }
  }
  // Before the commit, so that every committed block's namespace has a spec whenever an
  // inventory looks (a failed commit leaves a spec no block uses, which is harmless).
  specs_->Set(ns, spec, commit.max_page_age_s());
  // The manager's time, so that the ages the inventory reports are in the index's time
  // base; a manager that sends none gets the agent's own clock.
  const int64_t committed_unix_ms =
      commit.committed_unix_ms() > 0 ? commit.committed_unix_ms() : absl::ToUnixMillis(absl::Now());
  // "block_ids": the manager forwards the message to the worker whose Insert named them.
  return pool->Commit(
      ns, epoch_, entries, "block_ids", committed_unix_ms,
      {.committer = commit.committer(), .block_bytes = pool->geometry().bytes_per_block()});
}

absl::Status CommandExecutor::Release(const v1::ReleaseBlocks& release) {
  KVCM_ASSIGN_OR_RETURN(BlockPool * pool, PoolOf(release.tier(), "release.tier"));
  return pool->Release(Ids(release.block_ids()), epoch_, "release.block_ids");
}

absl::Status CommandExecutor::Free(const v1::FreeBlocks& free) {
  KVCM_ASSIGN_OR_RETURN(BlockPool * pool, PoolOf(free.tier(), "free.tier"));
  return pool->FreeCommitted(Ids(free.block_ids()), epoch_, "free.block_ids");
}

absl::StatusOr<std::vector<BlockId>> CommandExecutor::Demote(const v1::DemoteBlocks& demote) {
  if (host_pool_ == nullptr) {
    return absl::FailedPreconditionError("demote: this agent has no host pool");
  }
  const std::vector<BlockId> sources = Ids(demote.source_block_ids());
  if (absl::Status s = pool_->CheckOwned(sources, epoch_, "demote.source_block_ids"); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::vector<BlockId>> targets =
      host_pool_->Allocate(static_cast<uint32_t>(sources.size()), epoch_);
  if (!targets.ok()) return targets.status();
  if (absl::Status s = pool_->CopyBlocksTo(sources, *host_pool_, *targets, epoch_); !s.ok()) {
    (void)host_pool_->Free(*targets, epoch_);  // ours, just allocated: cannot fail
    return s;
  }
  return targets;
}

}  // namespace kvcm
