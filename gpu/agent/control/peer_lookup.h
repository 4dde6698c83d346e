// PeerLookup: where a peer agent serves its blocks, as the manager knows it
// (AgentControl.LookupAgent). BlockAgent.Fetch names its source by agent id and dials only
// the address this answers, so a worker cannot make an agent dial a host:port of its choice.
#ifndef KVCM_GPU_AGENT_CONTROL_PEER_LOOKUP_H_
#define KVCM_GPU_AGENT_CONTROL_PEER_LOOKUP_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm {

// Calls `done` exactly once, on any thread, with the data address ("host:port") of agent
// `peer_agent_id`; NOT_FOUND naming source_agent_id for an agent the manager does not know
// (or that is gone, or has no data port); the manager's other errors, prefixed.
using PeerAddressDone = std::function<void(absl::StatusOr<std::string> data_address)>;
using PeerLookup = std::function<void(const std::string& peer_agent_id, PeerAddressDone done)>;

// A PeerLookup asking the manager behind `control` (not owned; must outlive every lookup)
// as agent `agent_id`, each call bounded by `timeout_ms`. Thread-safe.
PeerLookup LookupAtManager(v1::AgentControl::Stub* control, std::string agent_id,
                           uint32_t timeout_ms);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_CONTROL_PEER_LOOKUP_H_
