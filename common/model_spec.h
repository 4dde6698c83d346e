// What one token of KV cache costs, in bytes, for each attention kind and dtype.
#ifndef KVCM_COMMON_MODEL_SPEC_H_
#define KVCM_COMMON_MODEL_SPEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace kvcm {

// Values match kvcm.v1.AttentionKind / kvcm.v1.KvDtype.
enum class AttentionKind : uint8_t { kMha = 1, kMqa = 2, kGqa = 3, kMla = 4 };
enum class KvDtype : uint8_t { kBf16 = 1, kFp16 = 2, kFp8 = 3, kInt8 = 4 };

inline constexpr uint32_t kDefaultPageSizeTokens = 64;

// A model's KV geometry. Plain value; Validate() before use.
struct ModelSpec {
  AttentionKind attention = AttentionKind::kMla;
  uint32_t num_layers = 0;
  uint32_t num_heads = 0;
  uint32_t num_kv_heads = 0;  // MHA: == num_heads; MQA: 1; GQA: divides num_heads.
  uint32_t head_dim = 0;      // MHA/MQA/GQA only.
  uint32_t kv_lora_rank = 0;  // MLA only.
  uint32_t rope_dim = 0;      // MLA only.
  // MLA only, and only for MhaShapedBytesPerToken(): per-head widths of the decompressed
  // no-RoPE key and of the value (DeepSeek-V3: 128 and 128). 0 means kv_lora_rank / 4.
  uint32_t qk_nope_head_dim = 0;
  uint32_t v_head_dim = 0;
  KvDtype dtype = KvDtype::kBf16;
  uint32_t page_size_tokens = kDefaultPageSizeTokens;
  // Opaque descriptor of one page's byte layout as the engine writes it, e.g.
  // "vllm-cpu/mla:[block,576]:bf16"; empty: not stated. At most kMaxKvLayoutBytes of
  // printable ASCII. Takes no part in the byte accounting; see CompatibleWith().
  std::string kv_layout;

  static constexpr size_t kMaxKvLayoutBytes = 256;

  // Every field equal, kv_layout included.
  friend bool operator==(const ModelSpec&, const ModelSpec&) = default;

  // INVALID_ARGUMENT naming the offending field when the geometry is impossible or
  // kv_layout is too long or not printable ASCII.
  absl::Status Validate() const;

  // Whether pages of this spec and of `other` may share a namespace: every field but
  // kv_layout equal, and the layouts equal or one of them empty (not stated).
  bool CompatibleWith(const ModelSpec& other) const;

  // KV bytes of one token in one layer:
  //   MHA      2 * num_heads    * head_dim * elem   (+ scales for int8)
  //   GQA/MQA  2 * num_kv_heads * head_dim * elem   (+ scales for int8)
  //   MLA      (kv_lora_rank + rope_dim) * elem; fp8 uses FlashMLA's layout:
  //            kv_lora_rank fp8 + kv_lora_rank/128 fp32 scales + rope_dim bf16 (656 B for
  //            DeepSeek-V3); int8 adds one fp32 scale for the latent.
  // REQUIRES: Validate().ok().
  uint64_t BytesPerTokenPerLayer() const;
  uint64_t BytesPerToken() const { return BytesPerTokenPerLayer() * num_layers; }
  uint64_t BytesPerPage() const { return BytesPerToken() * page_size_tokens; }

  // What a byte-blind cache that stores full per-head K and V would charge per token (all
  // layers), the baseline the "lru-mha" arm budgets with. MLA: num_heads * ((nope + rope)
  // + v) * elem per layer (DeepSeek-V3 bf16: 81,920 B, 71x its latent); the other kinds
  // charge 2 * num_heads * head_dim * elem, i.e. as if they were MHA.
  uint64_t MhaShapedBytesPerToken() const;

  std::string DebugString() const;
};

}  // namespace kvcm

#endif  // KVCM_COMMON_MODEL_SPEC_H_
