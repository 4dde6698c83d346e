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

// The core's enums and kvcm.v1's share their numbering; these are the only conversions
// between them, and the static_asserts below fail the build when either side changes.
// A FromProto takes a value its caller has validated (or trusts: the manager's answers).
constexpr v1::Tier TierToProto(Tier tier) { return static_cast<v1::Tier>(tier); }
constexpr Tier TierFromProto(v1::Tier tier) { return static_cast<Tier>(tier); }
constexpr v1::AttentionKind AttentionToProto(AttentionKind kind) {
  return static_cast<v1::AttentionKind>(kind);
}
constexpr AttentionKind AttentionFromProto(v1::AttentionKind kind) {
  return static_cast<AttentionKind>(kind);
}
constexpr v1::KvDtype DtypeToProto(KvDtype dtype) { return static_cast<v1::KvDtype>(dtype); }
constexpr KvDtype DtypeFromProto(v1::KvDtype dtype) { return static_cast<KvDtype>(dtype); }

static_assert(TierToProto(Tier::kGpu) == v1::TIER_GPU);
static_assert(TierToProto(Tier::kHost) == v1::TIER_HOST);
static_assert(TierToProto(Tier::kDisk) == v1::TIER_DISK);
static_assert(v1::Tier_MAX == v1::TIER_DISK, "a new v1::Tier needs a kvcm::Tier");
static_assert(AttentionToProto(AttentionKind::kMha) == v1::ATTENTION_KIND_MHA);
static_assert(AttentionToProto(AttentionKind::kMqa) == v1::ATTENTION_KIND_MQA);
static_assert(AttentionToProto(AttentionKind::kGqa) == v1::ATTENTION_KIND_GQA);
static_assert(AttentionToProto(AttentionKind::kMla) == v1::ATTENTION_KIND_MLA);
static_assert(v1::AttentionKind_MAX == v1::ATTENTION_KIND_MLA,
              "a new v1::AttentionKind needs a kvcm::AttentionKind");
static_assert(DtypeToProto(KvDtype::kBf16) == v1::KV_DTYPE_BF16);
static_assert(DtypeToProto(KvDtype::kFp16) == v1::KV_DTYPE_FP16);
static_assert(DtypeToProto(KvDtype::kFp8) == v1::KV_DTYPE_FP8);
static_assert(DtypeToProto(KvDtype::kInt8) == v1::KV_DTYPE_INT8);
static_assert(v1::KvDtype_MAX == v1::KV_DTYPE_INT8, "a new v1::KvDtype needs a kvcm::KvDtype");

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

// Missing spec, unknown attention or dtype, impossible geometry, or a kv_layout too long or
// not printable -> INVALID_ARGUMENT naming `field` or `field`.<member>. page_size_tokens 0
// becomes kDefaultPageSizeTokens.
absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::ModelSpec* spec,
                                             absl::string_view field = "spec");
// Every field as it is, unchecked: for answers from a peer that validated them (a client
// reading the manager's). ModelSpecFromProto is this plus its checks.
ModelSpec ModelSpecFromTrustedProto(const v1::ModelSpec& spec);

}  // namespace kvcm

#endif  // KVCM_PROTO_CORE_TYPES_H_
