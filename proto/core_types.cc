#include "proto/core_types.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvcm {
namespace {

constexpr size_t kMaxNameBytes = 128;

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// The offending value for an error message: escaped and cut to 64 bytes.
std::string Quoted(absl::string_view value) {
  constexpr size_t kMaxShown = 64;
  std::string shown = absl::CHexEscape(value.substr(0, kMaxShown));
  return absl::StrCat("\"", shown, value.size() > kMaxShown ? "...\"" : "\"");
}

}  // namespace

void NamespaceToProto(const NamespaceId& ns, v1::Namespace* out) {
  out->set_tenant(ns.tenant);
  out->set_model(ns.model);
}

void PoolToProto(const PoolKey& pool, v1::PoolRef* out) {
  out->set_agent_id(pool.agent_id);
  out->set_tier(TierToProto(pool.tier));
}

void ModelSpecToProto(const ModelSpec& spec, v1::ModelSpec* out) {
  out->set_attention(AttentionToProto(spec.attention));
  out->set_num_layers(spec.num_layers);
  out->set_num_heads(spec.num_heads);
  out->set_num_kv_heads(spec.num_kv_heads);
  out->set_head_dim(spec.head_dim);
  out->set_kv_lora_rank(spec.kv_lora_rank);
  out->set_rope_dim(spec.rope_dim);
  out->set_qk_nope_head_dim(spec.qk_nope_head_dim);
  out->set_v_head_dim(spec.v_head_dim);
  out->set_dtype(DtypeToProto(spec.dtype));
  out->set_page_size_tokens(spec.page_size_tokens);
  out->set_kv_layout(spec.kv_layout);
}

absl::Status ValidateName(absl::string_view value, absl::string_view field,
                          absl::string_view extra) {
  bool ok = !value.empty() && value.size() <= kMaxNameBytes;
  for (size_t i = 0; ok && i < value.size(); ++i) {
    ok = absl::ascii_isalnum(static_cast<unsigned char>(value[i])) ||
         extra.find(value[i]) != absl::string_view::npos;
  }
  if (ok) return absl::OkStatus();
  return Invalid(
      absl::StrCat(field, " must be 1..128 bytes of [A-Za-z0-9", extra, "], got ", Quoted(value)));
}

absl::StatusOr<NamespaceId> NamespaceFromProto(const v1::Namespace* ns, absl::string_view field) {
  if (ns == nullptr) return Invalid(absl::StrCat(field, " is required"));
  if (absl::Status s = ValidateName(ns->tenant(), absl::StrCat(field, ".tenant"), "._-"); !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateName(ns->model(), absl::StrCat(field, ".model"), "._/-"); !s.ok()) {
    return s;
  }
  return NamespaceId{ns->tenant(), ns->model()};
}

ModelSpec ModelSpecFromTrustedProto(const v1::ModelSpec& spec) {
  ModelSpec out;
  out.attention = AttentionFromProto(spec.attention());
  out.num_layers = spec.num_layers();
  out.num_heads = spec.num_heads();
  out.num_kv_heads = spec.num_kv_heads();
  out.head_dim = spec.head_dim();
  out.kv_lora_rank = spec.kv_lora_rank();
  out.rope_dim = spec.rope_dim();
  out.qk_nope_head_dim = spec.qk_nope_head_dim();
  out.v_head_dim = spec.v_head_dim();
  out.dtype = DtypeFromProto(spec.dtype());
  out.page_size_tokens = spec.page_size_tokens();
  out.kv_layout = spec.kv_layout();
  return out;
}

absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::ModelSpec* spec, absl::string_view field) {
  if (spec == nullptr) return Invalid(absl::StrCat(field, " is required"));
  switch (spec->attention()) {
    case v1::ATTENTION_KIND_MHA:
    case v1::ATTENTION_KIND_MQA:
    case v1::ATTENTION_KIND_GQA:
    case v1::ATTENTION_KIND_MLA:
      break;
    default:
      return Invalid(absl::StrCat(field,
                                  ".attention must be ATTENTION_KIND_MHA, _MQA, _GQA or _MLA, got ",
                                  static_cast<int>(spec->attention())));
  }
  switch (spec->dtype()) {
    case v1::KV_DTYPE_BF16:
    case v1::KV_DTYPE_FP16:
    case v1::KV_DTYPE_FP8:
    case v1::KV_DTYPE_INT8:
      break;
    default:
      return Invalid(absl::StrCat(field, ".dtype must be KV_DTYPE_BF16, _FP16, _FP8 or _INT8, got ",
                                  static_cast<int>(spec->dtype())));
  }
  ModelSpec out = ModelSpecFromTrustedProto(*spec);
  if (out.page_size_tokens == 0) out.page_size_tokens = kDefaultPageSizeTokens;
  if (absl::Status s = out.Validate(); !s.ok()) {
    // Validate's messages name "spec.<member>"; put them under `field`.
    absl::string_view message = s.message();
    if (absl::ConsumePrefix(&message, "spec")) return Invalid(absl::StrCat(field, message));
    return Invalid(absl::StrCat(field, ": ", message));
  }
  return out;
}

}  // namespace kvcm
