#include "server/service/agent_commands.h"

#include <deque>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/service/proto_convert.h"

namespace kvcm {

// One Commands call. Reads the hello, then acks until the agent closes; writes queued
// commands one at a time. Thread-safe: Enqueue and RequestFinish may be called from any
// thread; the read state is touched only by the (serialised) read reactions.
class AgentCommandRouter::Stream final
    : public grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand> {
 public:
  explicit Stream(AgentCommandRouter* router) : router_(router) { StartRead(&ack_); }

  // Set once, before Attach; read-only afterwards.
  const PoolKey& pool() const { return pool_; }

  // Queues `command` (its sequence is assigned here) and starts writing it if the stream is
  // idle. False when the queue is full or the stream is finishing: the command is dropped.
  bool Enqueue(v1::AgentCommand command) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (finishing_ || queue_.size() >= router_->max_queued_commands_) return false;
      command.set_sequence(next_sequence_++);
      queue_.push_back(std::move(command));
      if (!TakeNextWriteLocked()) return true;
    }
    StartWrite(&writing_);
    return true;
  }

  // Finishes the call with `status` now, or after the write in flight. Commands still queued
  // are dropped. Only the first call counts.
  void RequestFinish(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    size_t dropped = 0;
    bool finish_now = false;
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      finishing_ = true;
      finish_status_ = status;
      dropped = queue_.size();
      queue_.clear();
      finish_now = !write_in_flight_;
    }
    CountDropped(dropped);
    if (finish_now) Finish(status);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RequestFinish(grpc::Status::OK);  // the agent closed its side (or the call ended)
      return;
    }
    if (!hello_done_) {
      hello_done_ = true;
      if (grpc::Status s = AcceptHello(); !s.ok()) {
        RequestFinish(s);
        return;
      }
    } else {
      router_->metrics_->RecordAgentCommand(ack_.code() == 0 ? AgentCommandResult::kAcked
                                                             : AgentCommandResult::kFailed);
    }
    StartRead(&ack_);
  }

  void OnWriteDone(bool ok) override {
    bool finish = false;
    bool write = false;
    grpc::Status status;
    size_t dropped = 0;
    {
      absl::MutexLock lock(&mu_);
      write_in_flight_ = false;
      if (!ok && !finishing_) {  // the call is broken: nothing more can be written
        finishing_ = true;
        finish_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed");
        dropped = queue_.size() + 1;
        queue_.clear();
      }
      if (finishing_) {
        finish = true;
        status = finish_status_;
      } else {
        write = TakeNextWriteLocked();
      }
    }
    CountDropped(dropped);
    if (finish) Finish(status);
    if (write) StartWrite(&writing_);
  }

  void OnDone() override {
    router_->Detach(this);
    delete this;
  }

 private:
  // Checks the hello in ack_ against the registry and attaches the stream.
  grpc::Status AcceptHello() {
    if (absl::Status s = ValidateAgentId(ack_.agent_id(), "agent_id"); !s.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(s.message()));
    }
    if (ack_.epoch() < 1) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "epoch must be >= 1");
    }
    const std::vector<AgentInfo> agents = router_->agents_->Snapshot();
    const AgentInfo* found = nullptr;
    for (const AgentInfo& a : agents) {
      if (a.registration.agent_id == ack_.agent_id()) found = &a;
    }
    if (found == nullptr) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("agent ", ack_.agent_id(), " is not registered"));
    }
    if (found->registration.epoch != ack_.epoch()) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          absl::StrCat("agent ", ack_.agent_id(), " is registered with epoch ",
                                       found->registration.epoch, ", not ", ack_.epoch()));
    }
    pool_ = PoolKey{found->registration.agent_id, found->registration.tier};
    if (!router_->Attach(this)) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the manager is shutting down");
    }
    return grpc::Status::OK;
  }

  // Moves the next queued command into writing_ when no write is in flight.
  bool TakeNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (write_in_flight_ || queue_.empty()) return false;
    writing_ = std::move(queue_.front());
    queue_.pop_front();
    write_in_flight_ = true;
    return true;
  }

  void CountDropped(size_t n) {
    for (size_t i = 0; i < n; ++i)
      router_->metrics_->RecordAgentCommand(AgentCommandResult::kDropped);
  }

  AgentCommandRouter* const router_;
  // Read reactions only (gRPC runs at most one at a time).
  v1::AgentCommandAck ack_;
  bool hello_done_ = false;
  PoolKey pool_;

  absl::Mutex mu_;
  std::deque<v1::AgentCommand> queue_ ABSL_GUARDED_BY(mu_);
  // The command being written; owned by gRPC while write_in_flight_.
  v1::AgentCommand writing_;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
};

AgentCommandRouter::AgentCommandRouter(const AgentRegistry* agents, ServiceMetrics* metrics,
                                       size_t max_queued_commands)
    : agents_(agents), metrics_(metrics), max_queued_commands_(max_queued_commands) {}

void AgentCommandRouter::OnEvent(const CacheEvent& event) {
  if (event.kind != CacheEvent::Kind::kRemoved || event.block_ids.empty()) return;
  v1::AgentCommand command;
  v1::FreeBlocks* free = command.mutable_free();
  free->set_tier(static_cast<v1::Tier>(event.pool.tier));
  for (BlockId id : event.block_ids) {
    if (id != kPendingBlock) free->add_block_ids(id);
  }
  if (free->block_ids_size() == 0) return;
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(event.pool.agent_id);
  if (it == streams_.end() || it->second->pool() != event.pool) return;
  if (!it->second->Enqueue(std::move(command))) {
    metrics_->RecordAgentCommand(AgentCommandResult::kDropped);
  }
}

grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* AgentCommandRouter::Open() {
  return new Stream(this);
}

void AgentCommandRouter::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  for (auto& [agent_id, stream] : streams_) {
    stream->RequestFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the manager is stopping"));
  }
}

size_t AgentCommandRouter::open_streams() const {
  absl::MutexLock lock(&mu_);
  return streams_.size();
}

bool AgentCommandRouter::Attach(Stream* stream) {
  absl::MutexLock lock(&mu_);
  if (closed_) return false;
  Stream*& slot = streams_[stream->pool().agent_id];
  if (slot != nullptr) {
    slot->RequestFinish(
        grpc::Status(grpc::StatusCode::ABORTED, "replaced by a newer Commands stream"));
  }
  slot = stream;
  return true;
}

void AgentCommandRouter::Detach(Stream* stream) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(stream->pool().agent_id);
  if (it != streams_.end() && it->second == stream) streams_.erase(it);
}

}  // namespace kvcm
