// The agent's value types to and from their kvcm.v1 messages (as proto/core_types.h does for
// the core's). The manager validates with server/service/proto_convert.h, which the agent
// does not link; the parsers here apply the same rules. Stateless.
#ifndef KVCM_GPU_AGENT_AGENT_PROTO_H_
#define KVCM_GPU_AGENT_AGENT_PROTO_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "common/types.h"
#include "gpu/agent/pool_geometry.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

void PoolGeometryToProto(const PoolGeometry& geometry, v1::PoolGeometry* out);

// The namespace `ns`, at `field` of the request: INVALID_ARGUMENT naming `field`.tenant
// unless it is 1..128 bytes of [A-Za-z0-9._-], `field`.model unless 1..128 bytes of
// [A-Za-z0-9._/-].
absl::StatusOr<NamespaceId> ParseNamespace(const v1::Namespace& ns, absl::string_view field);

// The spec `spec` (page_size_tokens 0 meaning kDefaultPageSizeTokens), at `field` of the
// request: INVALID_ARGUMENT naming `field` or `field`.<member> for an unknown attention kind
// or dtype or a geometry ModelSpec::Validate refuses.
absl::StatusOr<ModelSpec> ParseModelSpec(const v1::ModelSpec& spec, absl::string_view field);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_AGENT_PROTO_H_
