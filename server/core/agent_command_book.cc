#include "server/core/agent_command_book.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {

absl::Status AgentCommandBookOptions::Validate() const {
  if (max_queued_commands == 0) {
    return absl::InvalidArgumentError("max_queued_commands must be >= 1");
  }
  return absl::OkStatus();
}

AgentCommandBook::AgentCommandBook(AgentCommandBookOptions options)
    : options_(std::move(options)) {}

AgentCommandBook::~AgentCommandBook() { Close(); }

void AgentCommandBook::OnRegistered(const std::string& agent_id, uint64_t epoch) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    auto it = agents_.find(agent_id);
    if (it == agents_.end()) {
      agents_.emplace(agent_id, Agent{CommandOutbox(epoch, options_.max_queued_commands)});
    } else if (it->second.outbox.epoch() < epoch) {
      StartEpochLocked(it->second, agent_id, epoch,
                       absl::StrCat("agent ", agent_id, " registered epoch ", epoch), deferred);
    }
  }
  Run(deferred);
}

void AgentCommandBook::Forget(const std::string& agent_id) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    auto it = agents_.find(agent_id);
    if (it == agents_.end()) return;
    DetachLocked(it->second,
                 absl::NotFoundError(absl::StrCat(
                     "agent ", agent_id, " was declared gone; register with a larger epoch")),
                 deferred);
    DropQueuedLocked(it->second,
                     absl::AbortedError(absl::StrCat("agent ", agent_id, " was declared gone")),
                     /*dropped=*/true, deferred);
    agents_.erase(it);
  }
  Run(deferred);
}

uint64_t AgentCommandBook::epoch(const std::string& agent_id) const {
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(agent_id);
  return it == agents_.end() ? 0 : it->second.outbox.epoch();
}

absl::StatusOr<uint64_t> AgentCommandBook::Enqueue(const std::string& agent_id, uint64_t epoch,
                                                   AgentCommandBody body, CommandCompletion done) {
  absl::StatusOr<uint64_t> sequence;
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError("the agent command book is closed");
    auto it = agents_.find(agent_id);
    if (it == agents_.end()) {
      return absl::NotFoundError(absl::StrCat("agent ", agent_id, " is not registered"));
    }
    Agent& agent = it->second;
    if (epoch != kCurrentEpoch && epoch != agent.outbox.epoch()) {
      return absl::AbortedError(
          absl::StrCat("agent ", agent_id, " is in epoch ", agent.outbox.epoch(), ", not ", epoch));
    }
    sequence = agent.outbox.Push(std::move(body), std::move(done));
    if (!sequence.ok()) {
      deferred.outcomes.push_back(CommandEnd::kDropped);
    } else if (agent.stream != nullptr) {
      deferred.wakes.push_back(agent.stream);
    }
  }
  Run(deferred);
  return sequence;
}

absl::StatusOr<AgentCommandBook::StreamId> AgentCommandBook::Attach(
    const std::string& agent_id, uint64_t epoch, std::shared_ptr<CommandStream> stream) {
  StreamId id = 0;
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError("the manager is stopping");
    auto it = agents_.find(agent_id);
    if (it == agents_.end()) {
      it = agents_.emplace(agent_id, Agent{CommandOutbox(epoch, options_.max_queued_commands)})
               .first;
    }
    Agent& agent = it->second;
    if (agent.outbox.epoch() > epoch) {
      return absl::AbortedError(absl::StrCat("agent ", agent_id, " is registered with epoch ",
                                             agent.outbox.epoch(), ", not ", epoch));
    }
    if (agent.outbox.epoch() < epoch) {  // the registration raced ahead of OnRegistered
      StartEpochLocked(agent, agent_id, epoch, "a newer epoch", deferred);
    }
    DetachLocked(agent, absl::AbortedError("replaced by a newer Commands stream"), deferred);
    id = next_stream_id_++;
    agent.stream_id = id;
    agent.stream = std::move(stream);
    agent.outbox.Rewind();
    stream_agents_.emplace(id, agent_id);
  }
  Run(deferred);
  return id;
}

std::optional<AgentCommand> AgentCommandBook::TakeNext(StreamId stream) {
  absl::MutexLock lock(&mu_);
  Agent* agent = FindStreamLocked(stream);
  if (agent == nullptr) return std::nullopt;
  return agent->outbox.TakeNext();
}

absl::Status AgentCommandBook::OnAck(StreamId stream, const AgentCommandAck& ack) {
  absl::Status result;
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    Agent* agent = FindStreamLocked(stream);
    if (agent == nullptr) return absl::OkStatus();  // replaced: the next stream resends
    absl::StatusOr<std::optional<CommandCompletion>> taken = agent->outbox.Ack(ack.sequence);
    if (!taken.ok()) {
      result = taken.status();
      DetachLocked(*agent, result, deferred);
    } else if (taken->has_value()) {
      deferred.outcomes.push_back(ack.status.ok() ? CommandEnd::kAcked : CommandEnd::kFailed);
      deferred.completions.emplace_back(std::move(**taken), ack);
    }
  }
  Run(deferred);
  return result;
}

void AgentCommandBook::Detach(StreamId stream) {
  absl::MutexLock lock(&mu_);
  Deferred unused;
  if (Agent* agent = FindStreamLocked(stream)) DetachLocked(*agent, std::nullopt, unused);
}

void AgentCommandBook::Close() {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    closed_ = true;
    for (auto& [agent_id, agent] : agents_) {
      DetachLocked(agent, absl::UnavailableError("the manager is stopping"), deferred);
      DropQueuedLocked(agent, absl::UnavailableError("the manager is stopping"),
                       /*dropped=*/false, deferred);
    }
  }
  Run(deferred);
}

size_t AgentCommandBook::open_streams() const {
  absl::MutexLock lock(&mu_);
  return stream_agents_.size();
}

size_t AgentCommandBook::unacked_commands(const std::string& agent_id) const {
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(agent_id);
  return it == agents_.end() ? 0 : it->second.outbox.unacked();
}

void AgentCommandBook::DetachLocked(Agent& agent, std::optional<absl::Status> end,
                                    Deferred& deferred) {
  if (agent.stream == nullptr) return;
  if (end.has_value()) deferred.ends.emplace_back(std::move(agent.stream), *std::move(end));
  stream_agents_.erase(agent.stream_id);
  agent.stream = nullptr;
  agent.stream_id = 0;
  agent.outbox.Rewind();
}

void AgentCommandBook::DropQueuedLocked(Agent& agent, const absl::Status& status, bool dropped,
                                        Deferred& deferred) {
  for (CommandCompletion& done : agent.outbox.TakeAll()) {
    if (dropped) deferred.outcomes.push_back(CommandEnd::kDropped);
    deferred.completions.emplace_back(std::move(done), status);
  }
}

void AgentCommandBook::StartEpochLocked(Agent& agent, const std::string& agent_id, uint64_t epoch,
                                        const std::string& why, Deferred& deferred) {
  DetachLocked(agent, absl::AbortedError(why), deferred);
  DropQueuedLocked(agent,
                   absl::AbortedError(absl::StrCat("epoch ", agent.outbox.epoch(), " of agent ",
                                                   agent_id, " ended")),
                   /*dropped=*/true, deferred);
  agent.outbox = CommandOutbox(epoch, options_.max_queued_commands);
}

AgentCommandBook::Agent* AgentCommandBook::FindStreamLocked(StreamId stream) {
  auto it = stream_agents_.find(stream);
  if (it == stream_agents_.end()) return nullptr;
  return &agents_.at(it->second);
}

void AgentCommandBook::Run(Deferred& deferred) {
  for (auto& [stream, status] : deferred.ends) stream->End(status);
  if (options_.on_command_end) {
    for (CommandEnd end : deferred.outcomes) options_.on_command_end(end);
  }
  for (auto& [done, result] : deferred.completions) {
    if (done) done(result);
  }
  for (const std::shared_ptr<CommandStream>& stream : deferred.wakes) stream->Wake();
}

}  // namespace kvcm
