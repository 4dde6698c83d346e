#include "server/core/command_outbox.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {

CommandOutbox::CommandOutbox(uint64_t epoch, size_t max_queued)
    : epoch_(epoch), max_queued_(max_queued) {}

absl::StatusOr<uint64_t> CommandOutbox::Push(AgentCommandBody body, CommandCompletion done) {
  if (unacked_.size() >= max_queued_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the agent's command queue is full (", max_queued_, " unacknowledged)"));
  }
  const uint64_t sequence = next_sequence_++;
  unacked_.push_back(
      Pending{AgentCommand{.sequence = sequence, .body = std::move(body)}, std::move(done)});
  return sequence;
}

std::optional<AgentCommand> CommandOutbox::TakeNext() {
  if (sent_ >= unacked_.size()) return std::nullopt;
  AgentCommand command = unacked_[sent_++].command;
  command.acked_through = acked_through_;
  return command;
}

absl::StatusOr<std::optional<CommandCompletion>> CommandOutbox::Ack(uint64_t sequence) {
  if (unacked_.empty() || sequence < unacked_.front().command.sequence) {
    return std::nullopt;  // a repeat of an ack already taken
  }
  if (sent_ == 0 || sequence != unacked_.front().command.sequence) {
    return absl::InvalidArgumentError(absl::StrCat("ack of sequence ", sequence, ", expected ",
                                                   unacked_.front().command.sequence));
  }
  CommandCompletion done = std::move(unacked_.front().done);
  unacked_.pop_front();
  --sent_;
  acked_through_ = sequence;
  return std::optional<CommandCompletion>(std::move(done));
}

std::vector<CommandCompletion> CommandOutbox::TakeAll() {
  std::vector<CommandCompletion> done;
  done.reserve(unacked_.size());
  for (Pending& p : unacked_) done.push_back(std::move(p.done));
  unacked_.clear();
  sent_ = 0;
  return done;
}

}  // namespace kvcm
