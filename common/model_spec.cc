#include "common/model_spec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/enum_names.h"

namespace kvcm {
namespace {

constexpr uint32_t kMaxLayers = 1024;
constexpr uint32_t kMaxHeads = 4096;
constexpr uint32_t kMaxDim = 8192;
constexpr uint32_t kMaxPageSizeTokens = 4096;

absl::Status OutOfRange(absl::string_view field, uint32_t value, uint32_t lo, uint32_t hi) {
  return absl::InvalidArgumentError(
      absl::StrCat("spec.", field, " must be in [", lo, ", ", hi, "], got ", value));
}

uint32_t ElementBytes(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kBf16:
    case KvDtype::kFp16:
      return 2;
    case KvDtype::kFp8:
    case KvDtype::kInt8:
      return 1;
  }
  return 2;
}

}  // namespace

absl::Status ModelSpec::Validate() const {
  switch (attention) {
    case AttentionKind::kMha:
    case AttentionKind::kMqa:
    case AttentionKind::kGqa:
    case AttentionKind::kMla:
      break;
    default:
      return absl::InvalidArgumentError("spec.attention must be MHA, MQA, GQA or MLA");
  }
  switch (dtype) {
    case KvDtype::kBf16:
    case KvDtype::kFp16:
    case KvDtype::kFp8:
    case KvDtype::kInt8:
      break;
    default:
      return absl::InvalidArgumentError("spec.dtype must be BF16, FP16, FP8 or INT8");
  }
  if (num_layers < 1 || num_layers > kMaxLayers) {
    return OutOfRange("num_layers", num_layers, 1, kMaxLayers);
  }
  if (num_heads < 1 || num_heads > kMaxHeads) {
    return OutOfRange("num_heads", num_heads, 1, kMaxHeads);
  }
  if (page_size_tokens < 1 || page_size_tokens > kMaxPageSizeTokens) {
    return OutOfRange("page_size_tokens", page_size_tokens, 1, kMaxPageSizeTokens);
  }
  if (kv_layout.size() > kMaxKvLayoutBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.kv_layout must be at most ", kMaxKvLayoutBytes, " bytes, got ", kv_layout.size()));
  }
  for (size_t i = 0; i < kv_layout.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(kv_layout[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.kv_layout must be printable ASCII (0x20..0x7e); byte ", i, " is 0x",
                       absl::Hex(c, absl::kZeroPad2)));
    }
  }
  if (attention == AttentionKind::kMla) {
    if (kv_lora_rank < 1 || kv_lora_rank > kMaxDim) {
      return OutOfRange("kv_lora_rank", kv_lora_rank, 1, kMaxDim);
    }
    if (rope_dim > kMaxDim) return OutOfRange("rope_dim", rope_dim, 0, kMaxDim);
    if (qk_nope_head_dim > kMaxDim) {
      return OutOfRange("qk_nope_head_dim", qk_nope_head_dim, 0, kMaxDim);
    }
    if (v_head_dim > kMaxDim) return OutOfRange("v_head_dim", v_head_dim, 0, kMaxDim);
    if (dtype == KvDtype::kFp8 && kv_lora_rank % 128 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.kv_lora_rank must be a multiple of 128 for FP8 MLA (one fp32 scale per 128 "
          "latents), got ",
          kv_lora_rank));
    }
    return absl::OkStatus();
  }
  if (head_dim < 1 || head_dim > kMaxDim) return OutOfRange("head_dim", head_dim, 1, kMaxDim);
  switch (attention) {
    case AttentionKind::kMha:
      if (num_kv_heads != 0 && num_kv_heads != num_heads) {
        return absl::InvalidArgumentError(absl::StrCat("spec.num_kv_heads must equal num_heads (",
                                                       num_heads, ") for MHA, got ", num_kv_heads));
      }
      break;
    case AttentionKind::kMqa:
      if (num_kv_heads > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("spec.num_kv_heads must be 1 for MQA, got ", num_kv_heads));
      }
      break;
    case AttentionKind::kGqa:
      if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) {
        return absl::InvalidArgumentError(absl::StrCat("spec.num_kv_heads must divide num_heads (",
                                                       num_heads, ") for GQA, got ", num_kv_heads));
      }
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

uint64_t ModelSpec::BytesPerTokenPerLayer() const {
  constexpr uint64_t kScaleBytes = 4;  // fp32
  const uint64_t elem = ElementBytes(dtype);
  if (attention == AttentionKind::kMla) {
    switch (dtype) {
      case KvDtype::kFp8:
        return kv_lora_rank + (kv_lora_rank / 128) * kScaleBytes + uint64_t{rope_dim} * 2;
      case KvDtype::kInt8:
        return kv_lora_rank + kScaleBytes + uint64_t{rope_dim} * 2;
      default:
        return (uint64_t{kv_lora_rank} + rope_dim) * elem;
    }
  }
  uint64_t heads = attention == AttentionKind::kMha   ? num_heads
                   : attention == AttentionKind::kMqa ? 1
                                                      : num_kv_heads;
  uint64_t bytes = 2 * heads * head_dim * elem;
  if (dtype == KvDtype::kInt8) bytes += 2 * heads * kScaleBytes;
  return bytes;
}

uint64_t ModelSpec::MhaShapedBytesPerToken() const {
  // fp8 / int8 scales are left out: the byte-blind arm only needs the shape.
  const uint64_t elem = ElementBytes(dtype);
  if (attention == AttentionKind::kMla) {
    const uint64_t nope = qk_nope_head_dim != 0 ? qk_nope_head_dim : kv_lora_rank / 4;
    const uint64_t v = v_head_dim != 0 ? v_head_dim : kv_lora_rank / 4;
    return uint64_t{num_heads} * (nope + rope_dim + v) * elem * num_layers;
  }
  return 2 * uint64_t{num_heads} * head_dim * elem * num_layers;
}

bool ModelSpec::CompatibleWith(const ModelSpec& other) const {
  if (kv_layout.empty() || other.kv_layout.empty()) {
    ModelSpec a = *this;
    a.kv_layout = other.kv_layout;
    return a == other;
  }
  return *this == other;
}

std::string ModelSpec::DebugString() const {
  std::string out = absl::StrCat(
      AttentionName(attention), " layers=", num_layers, " heads=", num_heads,
      " kv_heads=", num_kv_heads, " head_dim=", head_dim, " kv_lora_rank=", kv_lora_rank,
      " rope_dim=", rope_dim, " dtype=", DtypeName(dtype), " page=", page_size_tokens);
  if (!kv_layout.empty()) absl::StrAppend(&out, " kv_layout=\"", kv_layout, "\"");
  return out;
}

}  // namespace kvcm
