// The agent's value types in their kvcm.v1 messages (as proto/core_types.h does for the
// core's, whose validating readers the agent uses too). Stateless.
#ifndef KVCM_GPU_AGENT_CONTROL_AGENT_PROTO_H_
#define KVCM_GPU_AGENT_CONTROL_AGENT_PROTO_H_

#include "gpu/agent/pool/pool_geometry.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

void PoolGeometryToProto(const PoolGeometry& geometry, v1::PoolGeometry* out);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_CONTROL_AGENT_PROTO_H_
