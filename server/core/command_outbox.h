// CommandOutbox: the commands of one agent epoch that the agent has not acknowledged yet.
//
// Commands are numbered from 1 and acknowledged in order. A stream sends them one after
// the other (TakeNext); when a stream attaches or breaks (Rewind), sending starts again at
// the first unacknowledged command, so a command may reach the agent twice. At most
// max_queued commands wait; Push refuses more.
//
// Not thread-safe: AgentCommandBook guards it.
#ifndef KVCM_SERVER_CORE_COMMAND_OUTBOX_H_
#define KVCM_SERVER_CORE_COMMAND_OUTBOX_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/agent_command.h"

namespace kvcm {

class CommandOutbox {
 public:
  // REQUIRES: epoch >= 1, max_queued >= 1.
  CommandOutbox(uint64_t epoch, size_t max_queued);

  uint64_t epoch() const { return epoch_; }
  // Commands queued and not acknowledged.
  size_t unacked() const { return unacked_.size(); }
  // The highest sequence such that it and every one below it are acknowledged; 0 at first.
  uint64_t acked_through() const { return acked_through_; }
  // Whether TakeNext has a command to give.
  bool has_unsent() const { return sent_ < unacked_.size(); }

  // Queues `body` under the next sequence, which it returns; `done` (may be empty) is kept
  // for the ack. RESOURCE_EXHAUSTED when max_queued commands wait (nothing queued, `done`
  // dropped uncalled).
  absl::StatusOr<uint64_t> Push(AgentCommandBody body, CommandCompletion done);

  // The first command not sent since the last Rewind, with acked_through set, now counted
  // as sent; nullopt when every queued command was sent.
  std::optional<AgentCommand> TakeNext();

  // Sending starts again from the first unacknowledged command (a stream attached or
  // broke).
  void Rewind() { sent_ = 0; }

  // An ack of `sequence`. A value when it acknowledges the first unacknowledged command,
  // which is removed: that command's completion (possibly empty), for the caller to run.
  // nullopt for a repeat of an ack already taken (below the first unacknowledged).
  // INVALID_ARGUMENT, changing nothing, for any other sequence (one not sent yet, or past
  // the first unacknowledged).
  absl::StatusOr<std::optional<CommandCompletion>> Ack(uint64_t sequence);

  // Empties the outbox (the epoch ended), returning the completions of every unacknowledged
  // command in sequence order. Sequences keep counting from where they were.
  std::vector<CommandCompletion> TakeAll();

 private:
  struct Pending {
    AgentCommand command;  // sequence assigned
    CommandCompletion done;
  };

  uint64_t epoch_;
  size_t max_queued_;
  uint64_t next_sequence_ = 1;
  uint64_t acked_through_ = 0;
  std::deque<Pending> unacked_;  // in sequence order
  size_t sent_ = 0;              // unacked_[0, sent_) were sent since the last Rewind
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_COMMAND_OUTBOX_H_
