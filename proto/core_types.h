// The core's value types and their kvcm.v1 messages, for every process: writers, and the
// validating readers of the types every side receives (a namespace, a model spec, a name).
// The service's request conversions are in server/service/proto_convert.h; the client trusts
// the manager's answers (client/wire.h).
#ifndef KVCM_PROTO_CORE_TYPES_H_
#define KVCM_PROTO_CORE_TYPES_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "common/types.h"
#include "kvcm/v1/common.pb.h"

namespace kvcm {

void NamespaceToProto(const NamespaceId& ns, v1::Namespace* out);
void PoolToProto(const PoolKey& pool, v1::PoolRef* out);
void ModelSpecToProto(const ModelSpec& spec, v1::ModelSpec* out);

// INVALID_ARGUMENT naming `field` unless `value` is 1..128 bytes of [A-Za-z0-9] plus the
// characters in `extra`.
absl::Status ValidateName(absl::string_view value, absl::string_view field,
                          absl::string_view extra);

// `field` is the path used in error messages, e.g. "namespace". Missing namespace, tenant not
// 1..128 bytes of [A-Za-z0-9._-], or model not 1..128 bytes of [A-Za-z0-9._/-] ->
// INVALID_ARGUMENT naming `field`.tenant / `field`.model.
absl::StatusOr<NamespaceId> NamespaceFromProto(const v1::Namespace* ns, absl::string_view field);

// Missing spec, unknown attention or dtype, or impossible geometry -> INVALID_ARGUMENT naming
// `field` or `field`.<member>. page_size_tokens 0 becomes kDefaultPageSizeTokens.
absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::ModelSpec* spec,
                                             absl::string_view field = "spec");

}  // namespace kvcm

#endif  // KVCM_PROTO_CORE_TYPES_H_
