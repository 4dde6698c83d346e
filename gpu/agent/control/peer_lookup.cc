#include "gpu/agent/control/peer_lookup.h"

#include <chrono>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace kvcm {

PeerLookup LookupAtManager(v1::AgentControl::Stub* control, std::string agent_id,
                           uint32_t timeout_ms) {
  return [control, agent_id = std::move(agent_id), timeout_ms](const std::string& peer_agent_id,
                                                               PeerAddressDone done) {
    // Lives until the call completes.
    struct Call {
      grpc::ClientContext ctx;
      v1::LookupAgentRequest req;
      v1::LookupAgentResponse resp;
    };
    auto call = std::make_shared<Call>();
    call->req.set_agent_id(agent_id);
    call->req.set_peer_agent_id(peer_agent_id);
    call->ctx.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::milliseconds(timeout_ms));
    control->async()->LookupAgent(
        &call->ctx, &call->req, &call->resp,
        [call, peer_agent_id, done = std::move(done)](grpc::Status s) {
          absl::Status status = FromGrpcStatus(s);
          if (status.ok() && call->resp.data_address().empty()) {
            status = absl::NotFoundError("no data address");
          }
          if (status.ok()) return done(call->resp.data_address());
          if (status.code() == absl::StatusCode::kNotFound) {
            return done(absl::NotFoundError(
                absl::StrCat("source_agent_id \"", peer_agent_id,
                             "\" is not a live agent with a data port that the manager knows")));
          }
          done(absl::Status(status.code(),
                            absl::StrCat("source_agent_id \"", peer_agent_id,
                                         "\": looking it up at the manager: ", status.message())));
        });
  };
}

}  // namespace kvcm
