// AgentControl request handling on the manager: Register and Heartbeat validation and their
// registry calls, ReportInventory chunk sequences through the InventoryReceiver the stream
// reactor uses, the Commands stream (the hello, then AgentCommandAcks into the command
// book, with the commands the book hands out converted as the stream writes them), and
// NcclBootstrap, LookupAgent and MakeRoom, against a ManagerWorld. CacheManager Inserts into the
// agents' pools queue the CommitBlocks commands the acks complete. Records as in fuzz_input.h.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "fuzz/calls.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/manager_world.h"
#include "server/service/inventory_stream.h"

namespace kvcm::fuzz {
namespace {

using namespace agent_control_calls;  // NOLINT: the harness's calls

// What the book needs of a stream; the harness drains it after every message instead.
class FakeStream final : public CommandStream {
 public:
  void Wake() override {}
  void End(const absl::Status& status) override { ended = true; }
  bool ended = false;
};

struct Session {
  ManagerWorld world;
  std::optional<InventoryReceiver> inventory;
  std::shared_ptr<FakeStream> stream;
  AgentCommandBook::StreamId stream_id = 0;
  uint64_t incarnation = 0x1234;

  // What the Commands reactor's Pump writes: every command the book has for the stream.
  void Drain() {
    while (std::optional<AgentCommand> next = world.commands.TakeNext(stream_id)) {
      v1::AgentCommand out;
      AgentCommandToProto(*next, incarnation, &out);
    }
  }

  absl::Status CommandsMessage(const v1::AgentCommandAck& ack) {
    if (stream != nullptr && stream->ended) {  // the book ended it: the call is over
      stream.reset();
      stream_id = 0;
    }
    if (stream == nullptr) {  // the hello (CommandStreamReactor::AcceptHello)
      if (absl::Status s = ValidateAgentId(ack.agent_id(), "agent_id"); !s.ok()) return s;
      if (ack.epoch() < 1) return absl::InvalidArgumentError("epoch must be >= 1");
      if (absl::Status s = world.agents.CheckLive(ack.agent_id(), ack.epoch()); !s.ok()) {
        return s;
      }
      auto fresh = std::make_shared<FakeStream>();
      absl::StatusOr<AgentCommandBook::StreamId> id =
          world.commands.Attach(ack.agent_id(), ack.epoch(), fresh);
      if (!id.ok()) return id.status();
      stream = fresh;
      stream_id = *id;
      Drain();
      return absl::OkStatus();
    }
    absl::Status s = world.commands.OnAck(stream_id, AgentCommandAckFromProto(ack));
    Drain();
    return s;
  }

  absl::Status Run(Call call, std::string_view body) {
    switch (call) {
      case kRegister: {
        v1::RegisterAgentRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        return world.RegisterAgent(req);
      }
      case kHeartbeat: {
        v1::HeartbeatRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        if (absl::Status s = ValidateHeartbeat(req); !s.ok()) return s;
        return world.agents.Heartbeat(req.agent_id(), req.epoch(),
                                      {.used_bytes = req.used_bytes(),
                                       .free_blocks = req.free_blocks(),
                                       .pull_gbps = req.pull_gbps()});
      }
      case kInventoryChunk: {
        v1::InventoryChunk chunk;
        if (!Parse(body, &chunk)) return absl::InvalidArgumentError("unparsable");
        if (!inventory.has_value())
          inventory.emplace(world.index.get(), &world.agents, OpenPrincipal());
        absl::Status s = inventory->Take(chunk);
        if (!s.ok()) inventory.reset();  // a failed chunk ends the call
        return s;
      }
      case kInventoryClose: {
        if (!inventory.has_value()) return absl::OkStatus();
        v1::InventoryReply reply;
        absl::Status s = inventory->Restore(&reply);
        inventory.reset();
        return s;
      }
      case kCommandsMessage: {
        v1::AgentCommandAck ack;
        if (!Parse(body, &ack)) return absl::InvalidArgumentError("unparsable");
        return CommandsMessage(ack);
      }
      case kLookupAgent: {
        v1::LookupAgentRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        v1::LookupAgentResponse resp;
        absl::Status s = LookupAgentNow(world.agents, req, &resp);
        Require(!s.ok() || !resp.data_address().empty(), "LookupAgent: an address when OK");
        return s;
      }
      case kMakeRoom: {
        v1::MakeRoomRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        v1::MakeRoomResponse resp;
        return MakeRoomNow(*world.index, world.agents, req, &resp);
      }
      case kCommandsClose:
        if (stream_id != 0) world.commands.Detach(stream_id);
        stream.reset();
        stream_id = 0;
        return absl::OkStatus();
      case kNcclBootstrap: {
        v1::NcclBootstrapRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        absl::StatusOr<NcclLinkOffer> offer = NcclLinkOfferFromProto(req);
        if (!offer.ok()) return offer.status();
        if (absl::Status s = world.agents.CheckLive(req.agent_id(), req.epoch()); !s.ok()) return s;
        if (!world.relay.IsNccl(req.agent_id(), req.epoch())) {
          return absl::FailedPreconditionError("not nccl");
        }
        for (const AgentInfo& a : world.agents.Snapshot()) {
          if (a.registration.agent_id == req.peer_agent_id() && a.alive) {
            return world.relay.Relay(req.peer_agent_id(), a.registration.epoch, *std::move(offer));
          }
        }
        return absl::NotFoundError("peer");
      }
      case kInsert: {
        v1::InsertRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        absl::StatusOr<InsertCall> c = InsertFromProto(*world.index, req, world.limits);
        if (!c.ok()) return c.status();
        world.inserter.Insert(ToInsertCommand(*std::move(c)),
                              [](absl::StatusOr<InsertResult> result) {
                                v1::InsertResponse resp;
                                if (result.ok()) InsertResultToProto(*result, &resp);
                              });
        if (stream_id != 0) Drain();
        return absl::OkStatus();
      }
      case kAdvanceClock:
        world.clock.Advance(absl::Seconds(body.empty() ? 1 : static_cast<uint8_t>(body[0])));
        return absl::OkStatus();
      case kNumCalls:
        break;
    }
    return absl::OkStatus();
  }
};

}  // namespace
}  // namespace kvcm::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::fuzz;
  Session session;
  Records records(data, size);
  uint8_t tag;
  std::string_view body;
  while (records.Next(&tag, &body)) {
    const Call call = static_cast<Call>(tag % kNumCalls);
    Report(call, session.Run(call, body));
  }
  if (session.stream_id != 0) session.world.commands.Detach(session.stream_id);
  return 0;
}
