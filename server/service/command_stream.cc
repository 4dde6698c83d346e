#include "server/service/command_stream.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "server/service/access_control.h"
#include "server/service/proto_convert.h"

namespace kvcm {
namespace {

// An offer as the unnumbered AgentCommand that carries it.
void NcclLinkOfferToProto(const NcclLinkOffer& offer, uint64_t manager_incarnation,
                          v1::AgentCommand* out) {
  out->Clear();
  out->set_manager_incarnation(manager_incarnation);
  v1::NcclConnect* c = out->mutable_nccl_connect();
  c->set_from_agent_id(offer.from_agent_id);
  c->set_link_id(offer.link_id);
  c->set_unique_id(offer.unique_id);
  c->set_rank(offer.rank);
  c->set_peer_rank(offer.peer_rank);
  c->set_nranks(offer.nranks);
}

// One Commands call. Owned by itself (self_) until OnDone and by the book while attached.
// gRPC operations are started outside mu_, so no reaction can run inline under it; one
// write is in flight at a time (write_in_flight_ reserves it), and Finish waits for it.
// Lock order: a book sender's locks, then mu_ (Wake), then the book's or the relay's.
class CommandStreamReactor final
    : public grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>,
      public CommandStream,
      public std::enable_shared_from_this<CommandStreamReactor> {
 public:
  CommandStreamReactor(AgentCommandBook* book, const AgentRegistry* agents,
                       NcclBootstrapRelay* relay, uint64_t manager_incarnation,
                       absl::StatusOr<std::shared_ptr<const Principal>> caller)
      : book_(book),
        agents_(agents),
        relay_(relay),
        manager_incarnation_(manager_incarnation),
        caller_(std::move(caller)) {}

  void Start(std::shared_ptr<CommandStreamReactor> self) {
    self_ = std::move(self);
    if (!caller_.ok()) {
      FinishWith(ToGrpcStatus(caller_.status()));
      return;
    }
    StartRead(&ack_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the agent closed its side, or the call ended
      DetachFromBook();
      FinishWith(grpc::Status::OK);
      return;
    }
    if (!hello_done_) {
      hello_done_ = true;
      absl::StatusOr<AgentCommandBook::StreamId> id = AcceptHello();
      if (!id.ok()) {
        FinishWith(ToGrpcStatus(id.status()));
        return;
      }
      const NcclBootstrapRelay::StreamId relay_id =
          relay_->Attach(ack_.agent_id(), ack_.epoch(), shared_from_this());
      {
        absl::MutexLock lock(&mu_);
        id_ = *id;
        relay_id_ = relay_id;
      }
      Pump();
    } else if (!book_->OnAck(stream_id(), AgentCommandAckFromProto(ack_)).ok()) {
      return;  // out of order: the book ended the stream
    }
    StartRead(&ack_);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      write_in_flight_ = false;
      if (finishing_) finish = finish_status_;
    }
    if (finish.has_value()) {
      Finish(*finish);
    } else if (!ok) {  // the call is broken: nothing more can be written
      DetachFromBook();
      FinishWith(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
    } else {
      Pump();
    }
  }

  void OnDone() override {
    DetachFromBook();  // done without finishing through the book (e.g. cancelled)
    std::shared_ptr<CommandStreamReactor> last = std::move(self_);
  }

  // CommandStream.
  void Wake() override { Pump(); }
  void End(const absl::Status& status) override { FinishWith(ToGrpcStatus(status)); }

 private:
  // Checks the hello in ack_ against the registry and attaches the stream to the book.
  absl::StatusOr<AgentCommandBook::StreamId> AcceptHello() {
    if (absl::Status s = AuthorizeAgent(**caller_, ack_.agent_id()); !s.ok()) return s;
    if (absl::Status s = ValidateAgentId(ack_.agent_id(), "agent_id"); !s.ok()) {
      return absl::InvalidArgumentError(s.message());
    }
    if (ack_.epoch() < 1) return absl::InvalidArgumentError("epoch must be >= 1");
    if (absl::Status s = agents_->CheckLive(ack_.agent_id(), ack_.epoch()); !s.ok()) return s;
    return book_->Attach(ack_.agent_id(), ack_.epoch(), shared_from_this());
  }

  AgentCommandBook::StreamId stream_id() {
    absl::MutexLock lock(&mu_);
    return id_;
  }

  // Detaches from the book and the relay.
  void DetachFromBook() {
    NcclBootstrapRelay::StreamId relay_id = 0;
    {
      absl::MutexLock lock(&mu_);
      relay_id = relay_id_;
    }
    if (relay_id != 0) relay_->Detach(relay_id);
    if (const AgentCommandBook::StreamId id = stream_id(); id != 0) book_->Detach(id);
  }

  // Writes the relay's next link offer, else the book's next command, if the stream is
  // attached, idle and not finishing.
  void Pump() {
    {
      absl::MutexLock lock(&mu_);
      if (id_ == 0 || write_in_flight_ || finishing_) return;
      if (std::optional<NcclLinkOffer> offer = relay_->TakeNext(relay_id_); offer.has_value()) {
        NcclLinkOfferToProto(*offer, manager_incarnation_, &writing_);
      } else if (std::optional<AgentCommand> next = book_->TakeNext(id_); next.has_value()) {
        AgentCommandToProto(*next, manager_incarnation_, &writing_);
      } else {
        return;
      }
      write_in_flight_ = true;
    }
    StartWrite(&writing_);
  }

  // Finishes the call with `status` now or after the write in flight. Only the first call
  // counts.
  void FinishWith(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      finishing_ = true;
      if (write_in_flight_) {
        finish_status_ = status;
        return;
      }
    }
    Finish(status);
  }

  AgentCommandBook* const book_;
  const AgentRegistry* const agents_;
  NcclBootstrapRelay* const relay_;
  const uint64_t manager_incarnation_;
  // Who opened the stream; an error refuses it in Start.
  const absl::StatusOr<std::shared_ptr<const Principal>> caller_;
  // Keeps the reactor alive until OnDone.
  std::shared_ptr<CommandStreamReactor> self_;

  // Read reactions only (gRPC runs at most one at a time).
  v1::AgentCommandAck ack_;
  bool hello_done_ = false;

  absl::Mutex mu_;
  // The book's id of this stream once attached; 0 before.
  AgentCommandBook::StreamId id_ ABSL_GUARDED_BY(mu_) = 0;
  // The relay's id of this stream, set with id_.
  NcclBootstrapRelay::StreamId relay_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
  // The message being written: filled under mu_ by whoever sets write_in_flight_, then
  // owned by gRPC until OnWriteDone.
  v1::AgentCommand writing_;
};

}  // namespace

grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* OpenCommandStream(
    AgentCommandBook* book, const AgentRegistry* agents, NcclBootstrapRelay* relay,
    uint64_t manager_incarnation, absl::StatusOr<std::shared_ptr<const Principal>> caller) {
  auto reactor = std::make_shared<CommandStreamReactor>(book, agents, relay, manager_incarnation,
                                                        std::move(caller));
  reactor->Start(reactor);
  return reactor.get();
}

}  // namespace kvcm
