// AgentCommandBook: the manager's side of the command protocol with every agent.
//
// One CommandOutbox per agent, of the epoch it registered; a new epoch replaces it (the old
// epoch's commands die with that process). Senders Enqueue commands with a completion; at
// most one stream per agent is attached and pulls commands (TakeNext) and pushes acks
// (OnAck). The book tells a stream when there is something to send (CommandStream::Wake)
// and when it must end (CommandStream::End). See AgentControl.Commands in agent.proto.
//
// Thread-safe. Lock order: a sender's locks (CacheIndex's: its event listener enqueues),
// then a stream's own lock (Wake may be called under the sender's locks and calls
// TakeNext), then mu_. Completions, outcome reports and stream callbacks run after mu_ is
// released, on the thread of the call that caused them; the book never calls out under mu_.
#ifndef KVCM_SERVER_CORE_AGENT_COMMAND_BOOK_H_
#define KVCM_SERVER_CORE_AGENT_COMMAND_BOOK_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/agent_command.h"
#include "server/core/command_outbox.h"

namespace kvcm {

// A transport attached to the book for one agent (a gRPC stream in the manager). The book
// calls it outside its lock, from any thread, and possibly after it was detached (a late
// call must be harmless). Implementations may call TakeNext from Wake, and must not call
// any other method of the book while holding a lock that Wake takes.
class CommandStream {
 public:
  virtual ~CommandStream() = default;
  // Commands may be waiting: send what TakeNext gives, one after the other.
  virtual void Wake() = 0;
  // The book detached the stream and gives it nothing more: end it with `status`.
  virtual void End(const absl::Status& status) = 0;
};

// How a command ended, for metrics.
enum class CommandEnd {
  kAcked,    // acknowledged with an OK status
  kFailed,   // acknowledged with an error
  kDropped,  // refused by a full queue, or dropped unacknowledged when its epoch ended
};

struct AgentCommandBookOptions {
  // Unacknowledged commands one agent epoch may have queued; Enqueue refuses more.
  size_t max_queued_commands = 4096;
  // Called once per ended command (may be empty), outside the book's lock. Commands that
  // die with Close are not reported.
  std::function<void(CommandEnd)> on_command_end;

  // INVALID_ARGUMENT when max_queued_commands is 0.
  absl::Status Validate() const;
};

class AgentCommandBook {
 public:
  // Enqueue's `epoch` for "whichever epoch the agent has now".
  static constexpr uint64_t kCurrentEpoch = 0;
  using StreamId = uint64_t;

  // REQUIRES: options.Validate() is OK.
  explicit AgentCommandBook(AgentCommandBookOptions options = {});
  // Closes the book. REQUIRES: no stream is attached.
  ~AgentCommandBook();
  AgentCommandBook(const AgentCommandBook&) = delete;
  AgentCommandBook& operator=(const AgentCommandBook&) = delete;

  // The registry accepted `agent_id` in `epoch`. A newer epoch than the book's starts an
  // empty outbox: the old epoch's commands complete with ABORTED (counted dropped) and its
  // stream ends with ABORTED. The same or an older epoch changes nothing.
  void OnRegistered(const std::string& agent_id, uint64_t epoch) ABSL_LOCKS_EXCLUDED(mu_);

  // The agent was declared gone: its commands complete with ABORTED (counted dropped), its
  // stream ends with NOT_FOUND and the book forgets it.
  void Forget(const std::string& agent_id) ABSL_LOCKS_EXCLUDED(mu_);

  // The agent's epoch in the book; 0 when the book does not know the agent.
  uint64_t epoch(const std::string& agent_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Queues `body` for `agent_id` in `epoch` (kCurrentEpoch: the agent's epoch now) and
  // returns its sequence. OK means `done` (may be empty) will run exactly once: with the
  // agent's ack, or with ABORTED / UNAVAILABLE when the command dies unacknowledged (see
  // CommandCompletion). Any error means nothing was queued and `done` is never run:
  // NOT_FOUND when the book does not know the agent, ABORTED when the agent is in another
  // epoch, RESOURCE_EXHAUSTED when its queue is full (counted dropped), UNAVAILABLE after
  // Close. May wake the agent's stream; never runs a completion.
  absl::StatusOr<uint64_t> Enqueue(const std::string& agent_id, uint64_t epoch,
                                   AgentCommandBody body, CommandCompletion done)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Attaches `stream` to the outbox of `agent_id` in `epoch` (which the registry accepted)
  // and returns its id; sending restarts at the first unacknowledged command, which the
  // caller starts with TakeNext. An older stream of the agent ends with ABORTED. A newer
  // epoch than the book's starts a new outbox as OnRegistered does. Errors, with nothing
  // attached: ABORTED when the agent has a newer epoch, UNAVAILABLE after Close.
  absl::StatusOr<StreamId> Attach(const std::string& agent_id, uint64_t epoch,
                                  std::shared_ptr<CommandStream> stream) ABSL_LOCKS_EXCLUDED(mu_);

  // The next command for `stream` to send, with acked_through set; nullopt when none is
  // waiting or the stream is not attached.
  std::optional<AgentCommand> TakeNext(StreamId stream) ABSL_LOCKS_EXCLUDED(mu_);

  // An ack read on `stream`. The ack of the first unacknowledged command completes it
  // (counted acked or failed by its status); a repeat, or an ack on a stream no longer
  // attached, is ignored. INVALID_ARGUMENT for an ack out of order: the stream is detached
  // and ended with that status.
  absl::Status OnAck(StreamId stream, const AgentCommandAck& ack) ABSL_LOCKS_EXCLUDED(mu_);

  // The stream ended on its own: detaches it (without End); what it sent and was not
  // acknowledged goes to the next stream. Unknown ids are ignored.
  void Detach(StreamId stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends every stream with UNAVAILABLE, completes every queued command with UNAVAILABLE
  // (not counted) and refuses new streams and commands. Idempotent.
  void Close() ABSL_LOCKS_EXCLUDED(mu_);

  // Agents with an attached stream.
  size_t open_streams() const ABSL_LOCKS_EXCLUDED(mu_);
  // Commands queued for `agent_id` and not yet acknowledged.
  size_t unacked_commands(const std::string& agent_id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Agent {
    CommandOutbox outbox;
    StreamId stream_id = 0;  // 0: no stream attached
    std::shared_ptr<CommandStream> stream;
  };
  // What a call does after releasing mu_, in this order.
  struct Deferred {
    std::vector<std::pair<std::shared_ptr<CommandStream>, absl::Status>> ends;
    std::vector<CommandEnd> outcomes;
    std::vector<std::pair<CommandCompletion, absl::StatusOr<AgentCommandAck>>> completions;
    std::vector<std::shared_ptr<CommandStream>> wakes;
  };

  // Detaches the agent's stream, if any, and ends it with `end` (none: the stream left).
  void DetachLocked(Agent& agent, std::optional<absl::Status> end, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes every queued command of the agent with `status`; `dropped`: report them.
  void DropQueuedLocked(Agent& agent, const absl::Status& status, bool dropped, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the agent's epoch (stream ended with ABORTED `why`) and starts `epoch`.
  void StartEpochLocked(Agent& agent, const std::string& agent_id, uint64_t epoch,
                        const std::string& why, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Agent* FindStreamLocked(StreamId stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(Deferred& deferred) ABSL_LOCKS_EXCLUDED(mu_);

  const AgentCommandBookOptions options_;

  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, Agent> agents_ ABSL_GUARDED_BY(mu_);
  // Agent id of each attached stream.
  absl::flat_hash_map<StreamId, std::string> stream_agents_ ABSL_GUARDED_BY(mu_);
  StreamId next_stream_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_AGENT_COMMAND_BOOK_H_
