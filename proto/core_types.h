// The core's value types written into their kvcm.v1 messages. No validation happens here:
// the service validates what it receives (server/service/proto_convert.h), the client
// trusts the manager (client/wire.h). Both write with these.
#ifndef KVCM_PROTO_CORE_TYPES_H_
#define KVCM_PROTO_CORE_TYPES_H_

#include "common/model_spec.h"
#include "common/types.h"
#include "kvcm/v1/common.pb.h"

namespace kvcm {

void NamespaceToProto(const NamespaceId& ns, v1::Namespace* out);
void PoolToProto(const PoolKey& pool, v1::PoolRef* out);
void ModelSpecToProto(const ModelSpec& spec, v1::ModelSpec* out);

}  // namespace kvcm

#endif  // KVCM_PROTO_CORE_TYPES_H_
