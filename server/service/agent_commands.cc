#include "server/service/agent_commands.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/service/proto_convert.h"

namespace kvcm {

// One Commands call: reads the hello, then acks until the agent closes; writes what the
// router hands it, one message at a time. Everything but the read buffer is guarded by the
// router's mu_; the read state is touched only by the (serialised) read reactions.
class AgentCommandRouter::Stream final
    : public grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand> {
 public:
  explicit Stream(AgentCommandRouter* router) : router_(router) { StartRead(&ack_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the agent closed its side, or the call ended
      absl::MutexLock lock(&router_->mu_);
      router_->FinishLocked(this, grpc::Status::OK);
      return;
    }
    if (!hello_done_) {
      hello_done_ = true;
      grpc::Status s = AcceptHello();
      if (!s.ok()) {
        absl::MutexLock lock(&router_->mu_);
        router_->FinishLocked(this, s);
        return;
      }
    } else if (!router_->OnAck(this, ack_)) {
      return;  // the router finished the call
    }
    StartRead(&ack_);
  }

  void OnWriteDone(bool ok) override { router_->OnWriteDone(this, ok); }

  void OnDone() override {
    router_->OnDone(this);
    delete this;
  }

 private:
  friend class AgentCommandRouter;

  // Checks the hello in ack_ against the registry and attaches the stream.
  grpc::Status AcceptHello() {
    if (absl::Status s = ValidateAgentId(ack_.agent_id(), "agent_id"); !s.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(s.message()));
    }
    if (ack_.epoch() < 1) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "epoch must be >= 1");
    }
    if (absl::Status s = router_->agents_->CheckLive(ack_.agent_id(), ack_.epoch()); !s.ok()) {
      return ToGrpcStatus(s);
    }
    return router_->Attach(this, ack_.agent_id(), ack_.epoch());
  }

  AgentCommandRouter* const router_;
  // Read reactions only (gRPC runs at most one at a time).
  v1::AgentCommandAck ack_;
  bool hello_done_ = false;

  // Set by Attach; the outbox is outboxes_[agent_id_] while attached_.
  std::string agent_id_ ABSL_GUARDED_BY(router_->mu_);
  bool attached_ ABSL_GUARDED_BY(router_->mu_) = false;
  // The message being written; owned by gRPC while write_in_flight_.
  v1::AgentCommand writing_;
  bool write_in_flight_ ABSL_GUARDED_BY(router_->mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(router_->mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(router_->mu_);
};

AgentCommandRouter::AgentCommandRouter(CacheIndex* index, const AgentRegistry* agents,
                                       ServiceMetrics* metrics, size_t max_queued_commands)
    : index_(index),
      agents_(agents),
      metrics_(metrics),
      max_queued_commands_(max_queued_commands) {}

void AgentCommandRouter::OnEvent(const CacheEvent& event) {
  if (event.kind == CacheEvent::Kind::kRemoved) {
    v1::AgentCommand command;
    v1::FreeBlocks* free = command.mutable_free();
    free->set_tier(static_cast<v1::Tier>(event.pool.tier));
    for (BlockId id : event.block_ids) {
      if (id != kPendingBlock) free->add_block_ids(id);  // never reported: nothing to free
    }
    if (free->block_ids_size() > 0) Enqueue(event.pool.agent_id, std::move(command), {});
  } else if (event.kind == CacheEvent::Kind::kStored && event.demoted_from.has_value()) {
    v1::AgentCommand command;
    command.mutable_demote()->mutable_source_block_ids()->Add(event.source_block_ids.begin(),
                                                              event.source_block_ids.end());
    Demotion demotion{.ns = event.ns,
                      .pool = event.pool,
                      .path = event.prefix,
                      .first_page = static_cast<uint32_t>(event.prefix.size())};
    demotion.path.insert(demotion.path.end(), event.pages.begin(), event.pages.end());
    Enqueue(event.demoted_from->agent_id, std::move(command), std::move(demotion));
  }
}

void AgentCommandRouter::OnRegistered(const std::string& agent_id, uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  Outbox& outbox = outboxes_[agent_id];
  if (outbox.epoch >= epoch) return;
  if (outbox.stream != nullptr) {
    FinishLocked(outbox.stream,
                 grpc::Status(grpc::StatusCode::ABORTED,
                              absl::StrCat("agent ", agent_id, " registered epoch ", epoch)));
  }
  CountDropped(outbox.unacked.size());
  outbox = Outbox{.epoch = epoch};
}

void AgentCommandRouter::Forget(const std::string& agent_id) {
  absl::MutexLock lock(&mu_);
  auto it = outboxes_.find(agent_id);
  if (it == outboxes_.end()) return;
  if (it->second.stream != nullptr) {
    FinishLocked(it->second.stream,
                 grpc::Status(grpc::StatusCode::NOT_FOUND,
                              absl::StrCat("agent ", agent_id,
                                           " was declared gone; register with a larger epoch")));
  }
  CountDropped(it->second.unacked.size());
  outboxes_.erase(it);
}

grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* AgentCommandRouter::Open() {
  return new Stream(this);
}

void AgentCommandRouter::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  for (auto& [agent_id, outbox] : outboxes_) {
    if (outbox.stream != nullptr) {
      FinishLocked(outbox.stream,
                   grpc::Status(grpc::StatusCode::UNAVAILABLE, "the manager is stopping"));
    }
  }
}

size_t AgentCommandRouter::open_streams() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [agent_id, outbox] : outboxes_) n += outbox.stream != nullptr;
  return n;
}

size_t AgentCommandRouter::unacked_commands(const std::string& agent_id) const {
  absl::MutexLock lock(&mu_);
  auto it = outboxes_.find(agent_id);
  return it == outboxes_.end() ? 0 : it->second.unacked.size();
}

void AgentCommandRouter::Enqueue(const std::string& agent_id, v1::AgentCommand command,
                                 std::optional<Demotion> demotion) {
  absl::MutexLock lock(&mu_);
  auto it = outboxes_.find(agent_id);
  if (it == outboxes_.end()) return;  // a pool no agent registered (e.g. filled by Insert alone)
  EnqueueLocked(it->second, std::move(command), std::move(demotion));
}

void AgentCommandRouter::EnqueueLocked(Outbox& outbox, v1::AgentCommand command,
                                       std::optional<Demotion> demotion) {
  if (outbox.unacked.size() >= max_queued_commands_) {
    CountDropped(1);
    return;
  }
  command.set_sequence(outbox.next_sequence++);
  outbox.unacked.push_back(Pending{std::move(command), std::move(demotion)});
  MaybeWriteLocked(outbox);
}

void AgentCommandRouter::MaybeWriteLocked(Outbox& outbox) {
  Stream* s = outbox.stream;
  if (s == nullptr || s->write_in_flight_ || s->finishing_ ||
      outbox.sent >= outbox.unacked.size()) {
    return;
  }
  s->writing_ = outbox.unacked[outbox.sent++].command;
  s->writing_.set_acked_through(outbox.acked_through);
  s->write_in_flight_ = true;
  s->StartWrite(&s->writing_);
}

void AgentCommandRouter::CountDropped(size_t n) {
  for (size_t i = 0; i < n; ++i) metrics_->RecordAgentCommand(AgentCommandResult::kDropped);
}

grpc::Status AgentCommandRouter::Attach(Stream* stream, const std::string& agent_id,
                                        uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  if (closed_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the manager is stopping");
  Outbox& outbox = outboxes_[agent_id];
  if (outbox.epoch > epoch) {
    return grpc::Status(grpc::StatusCode::ABORTED,
                        absl::StrCat("agent ", agent_id, " is registered with epoch ", outbox.epoch,
                                     ", not ", epoch));
  }
  if (outbox.epoch < epoch) {  // the registration raced ahead of OnRegistered
    if (outbox.stream != nullptr) {
      FinishLocked(outbox.stream, grpc::Status(grpc::StatusCode::ABORTED, "a newer epoch"));
    }
    CountDropped(outbox.unacked.size());
    outbox = Outbox{.epoch = epoch};
  }
  if (outbox.stream != nullptr) {
    FinishLocked(outbox.stream,
                 grpc::Status(grpc::StatusCode::ABORTED, "replaced by a newer Commands stream"));
  }
  outbox.stream = stream;
  outbox.sent = 0;  // resend everything not acknowledged
  stream->agent_id_ = agent_id;
  stream->attached_ = true;
  MaybeWriteLocked(outbox);
  return grpc::Status::OK;
}

bool AgentCommandRouter::OnAck(Stream* stream, const v1::AgentCommandAck& ack) {
  std::string agent_id;
  uint64_t epoch = 0;
  std::optional<Demotion> demotion;
  {
    absl::MutexLock lock(&mu_);
    if (!stream->attached_) return true;  // replaced or finishing: the next stream resends
    Outbox& outbox = outboxes_.at(stream->agent_id_);
    if (outbox.unacked.empty() || ack.sequence() < outbox.unacked.front().command.sequence()) {
      return true;  // a repeat of an ack already taken
    }
    if (outbox.sent == 0 || ack.sequence() != outbox.unacked.front().command.sequence()) {
      FinishLocked(stream,
                   grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                absl::StrCat("ack of sequence ", ack.sequence(), ", expected ",
                                             outbox.unacked.front().command.sequence())));
      return false;
    }
    demotion = std::move(outbox.unacked.front().demotion);
    outbox.unacked.pop_front();
    --outbox.sent;
    outbox.acked_through = ack.sequence();
    agent_id = stream->agent_id_;
    epoch = outbox.epoch;
  }
  metrics_->RecordAgentCommand(ack.code() == 0 ? AgentCommandResult::kAcked
                                               : AgentCommandResult::kFailed);
  if (!demotion.has_value()) return true;
  if (ack.code() != 0) {
    // The agent holds no copy: take the pending HOST pages back out of the index.
    (void)index_->AbandonPending(demotion->ns, demotion->path, demotion->first_page,
                                 demotion->pool);
    return true;
  }

  const std::vector<BlockId> blocks(ack.block_ids().begin(), ack.block_ids().end());
  absl::StatusOr<std::vector<BlockId>> unassigned = index_->AssignBlocks(
      demotion->ns, demotion->path, demotion->first_page, demotion->pool, blocks);
  if (!unassigned.ok()) {
    // A malformed answer (e.g. the wrong number of blocks): the index cannot use it, so the
    // pages are undone as for a failed copy, and the blocks named are freed below.
    (void)index_->AbandonPending(demotion->ns, demotion->path, demotion->first_page,
                                 demotion->pool);
  }
  const std::vector<BlockId> to_free = unassigned.ok() ? *std::move(unassigned) : blocks;
  if (to_free.empty()) return true;
  v1::AgentCommand command;
  command.mutable_free()->set_tier(static_cast<v1::Tier>(demotion->pool.tier));
  command.mutable_free()->mutable_block_ids()->Add(to_free.begin(), to_free.end());
  absl::MutexLock lock(&mu_);
  auto it = outboxes_.find(agent_id);
  // Blocks of an epoch that has ended died with it.
  if (it != outboxes_.end() && it->second.epoch == epoch) {
    EnqueueLocked(it->second, std::move(command), {});
  }
  return true;
}

void AgentCommandRouter::OnWriteDone(Stream* stream, bool ok) {
  absl::MutexLock lock(&mu_);
  stream->write_in_flight_ = false;
  if (stream->finishing_) {
    stream->Finish(stream->finish_status_);
    return;
  }
  if (!ok) {  // the call is broken: nothing more can be written
    FinishLocked(stream, grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
    return;
  }
  if (stream->attached_) MaybeWriteLocked(outboxes_.at(stream->agent_id_));
}

void AgentCommandRouter::FinishLocked(Stream* stream, const grpc::Status& status) {
  if (stream->finishing_) return;
  stream->finishing_ = true;
  stream->finish_status_ = status;
  if (stream->attached_) {
    stream->attached_ = false;
    Outbox& outbox = outboxes_.at(stream->agent_id_);
    outbox.stream = nullptr;
    outbox.sent = 0;
  }
  if (!stream->write_in_flight_) stream->Finish(status);
}

void AgentCommandRouter::OnDone(Stream* stream) {
  absl::MutexLock lock(&mu_);
  if (stream->attached_) {  // done without finishing through the router (e.g. cancelled)
    stream->attached_ = false;
    Outbox& outbox = outboxes_.at(stream->agent_id_);
    outbox.stream = nullptr;
    outbox.sent = 0;
  }
}

}  // namespace kvcm
