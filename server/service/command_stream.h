// The gRPC side of AgentControl.Commands: one reactor per call moves messages between the
// wire and the AgentCommandBook, which holds the protocol. It reads the hello (checked
// against the AgentRegistry, then attached to the book), then acks, converted and handed to
// the book; it writes what the book gives, one write in flight; it finishes when the agent
// closes its side, a write fails, or the book ends the stream. It also writes the NCCL link
// offers the NcclBootstrapRelay holds for the agent (sequence 0, unacknowledged), before
// the book's next command.
#ifndef KVCM_SERVER_SERVICE_COMMAND_STREAM_H_
#define KVCM_SERVER_SERVICE_COMMAND_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "common/token_table.h"
#include "kvcm/v1/agent.pb.h"
#include "server/core/agent_command_book.h"
#include "server/core/agent_registry.h"
#include "server/service/nccl_bootstrap_relay.h"

namespace kvcm {

// The reactor of one Commands call of `caller`; it deletes itself once the call is done and
// the book has let go of it. A caller that did not authenticate is refused before anything
// is read; the hello's agent_id must be one the caller may act as (AuthorizeAgent).
// `book`, `agents` and `relay` are not owned and must outlive every call; every command
// written carries `manager_incarnation`.
grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* OpenCommandStream(
    AgentCommandBook* book, const AgentRegistry* agents, NcclBootstrapRelay* relay,
    uint64_t manager_incarnation, absl::StatusOr<std::shared_ptr<const Principal>> caller);

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_COMMAND_STREAM_H_
