#include "gpu/agent/agent_proto.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

constexpr size_t kMaxNameBytes = 128;

// 1..128 bytes of [A-Za-z0-9] plus the characters in `extra`.
absl::Status ValidateName(absl::string_view value, absl::string_view field,
                          absl::string_view extra) {
  bool ok = !value.empty() && value.size() <= kMaxNameBytes;
  for (size_t i = 0; ok && i < value.size(); ++i) {
    ok = absl::ascii_isalnum(static_cast<unsigned char>(value[i])) ||
         extra.find(value[i]) != absl::string_view::npos;
  }
  if (ok) return absl::OkStatus();
  constexpr size_t kMaxShown = 64;
  return absl::InvalidArgumentError(absl::StrCat(
      field, " must be 1..128 bytes of [A-Za-z0-9", extra, "], got \"",
      absl::CHexEscape(value.substr(0, kMaxShown)), value.size() > kMaxShown ? "...\"" : "\""));
}

}  // namespace

void PoolGeometryToProto(const PoolGeometry& geometry, v1::PoolGeometry* out) {
  ModelSpecToProto(geometry.spec, out->mutable_spec());
  out->set_bytes_per_block(geometry.bytes_per_block());
  out->set_num_blocks(geometry.num_blocks);
}

absl::StatusOr<NamespaceId> ParseNamespace(const v1::Namespace& ns, absl::string_view field) {
  KVCM_RETURN_IF_ERROR(ValidateName(ns.tenant(), absl::StrCat(field, ".tenant"), "._-"));
  KVCM_RETURN_IF_ERROR(ValidateName(ns.model(), absl::StrCat(field, ".model"), "._/-"));
  return NamespaceId{ns.tenant(), ns.model()};
}

absl::StatusOr<ModelSpec> ParseModelSpec(const v1::ModelSpec& spec, absl::string_view field) {
  ModelSpec out;
  switch (spec.attention()) {
    case v1::ATTENTION_KIND_MHA:
    case v1::ATTENTION_KIND_MQA:
    case v1::ATTENTION_KIND_GQA:
    case v1::ATTENTION_KIND_MLA:
      out.attention = static_cast<AttentionKind>(spec.attention());  // same values
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".attention must be ATTENTION_KIND_MHA, _MQA, _GQA or _MLA, got ",
                       static_cast<int>(spec.attention())));
  }
  switch (spec.dtype()) {
    case v1::KV_DTYPE_BF16:
    case v1::KV_DTYPE_FP16:
    case v1::KV_DTYPE_FP8:
    case v1::KV_DTYPE_INT8:
      out.dtype = static_cast<KvDtype>(spec.dtype());  // same values
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dtype must be KV_DTYPE_BF16, _FP16, _FP8 or _INT8, got ",
                       static_cast<int>(spec.dtype())));
  }
  out.num_layers = spec.num_layers();
  out.num_heads = spec.num_heads();
  out.num_kv_heads = spec.num_kv_heads();
  out.head_dim = spec.head_dim();
  out.kv_lora_rank = spec.kv_lora_rank();
  out.rope_dim = spec.rope_dim();
  out.qk_nope_head_dim = spec.qk_nope_head_dim();
  out.v_head_dim = spec.v_head_dim();
  out.page_size_tokens =
      spec.page_size_tokens() == 0 ? kDefaultPageSizeTokens : spec.page_size_tokens();
  if (absl::Status s = out.Validate(); !s.ok()) {
    // Validate's messages name "spec.<member>"; put them under `field`.
    absl::string_view message = s.message();
    if (absl::ConsumePrefix(&message, "spec")) {
      return absl::InvalidArgumentError(absl::StrCat(field, message));
    }
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
  }
  return out;
}

}  // namespace kvcm
