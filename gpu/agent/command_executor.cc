#include "gpu/agent/command_executor.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvcm {

CommandExecutor::CommandExecutor(BlockPool* pool, Tier tier, BlockPool* host_pool)
    : pool_(pool), tier_(tier), host_pool_(host_pool) {}

void CommandExecutor::Reset(uint64_t epoch) {
  epoch_ = epoch;
  last_sequence_ = 0;
  recent_.clear();
}

v1::AgentCommandAck CommandExecutor::Execute(const v1::AgentCommand& command) {
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

absl::Status CommandExecutor::Free(const v1::FreeBlocks& free) {
  BlockPool* pool = nullptr;
  if (free.tier() == static_cast<v1::Tier>(tier_)) {
    pool = pool_;
  } else if (free.tier() == v1::TIER_HOST) {
    pool = host_pool_;
  }
  if (pool == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("free.tier ", static_cast<int>(free.tier()), " is not a pool of this agent"));
  }
  const std::vector<BlockId> ids(free.block_ids().begin(), free.block_ids().end());
  return pool->Free(ids, epoch_);
}

absl::StatusOr<std::vector<BlockId>> CommandExecutor::Demote(const v1::DemoteBlocks& demote) {
  if (host_pool_ == nullptr) {
    return absl::FailedPreconditionError("demote: this agent has no host pool");
  }
  const std::vector<BlockId> sources(demote.source_block_ids().begin(),
                                     demote.source_block_ids().end());
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
