#include "common/model_catalog.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcm {
namespace {

// Dimensions come from each model's config.json on Hugging Face; the comments name the
// repository and the config fields. MLA caches one latent per token and layer shared by
// all heads, so num_kv_heads (the config's num_key_value_heads, 128 for DeepSeek-V3) plays
// no part in its bytes and is left 0. The other kinds have no head_dim field in their
// configs: it is hidden_size / num_attention_heads.
//
// A function-local static, not constexpr: ModelSpec holds a std::string (kv_layout), which
// clang with libstdc++ 12 cannot build in a constant expression, and a namespace-scope
// array would be initialised dynamically, after any other file's static initialiser that
// asks for a model.
std::span<const CatalogModel> Models() {
  static const CatalogModel kModels[] = {
      // deepseek-ai/DeepSeek-V3: num_hidden_layers 61, num_attention_heads 128,
      // kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128.
      {"deepseek-v3", "DeepSeek",
       ModelSpec{.attention = AttentionKind::kMla,
                 .num_layers = 61,
                 .num_heads = 128,
                 .kv_lora_rank = 512,
                 .rope_dim = 64,
                 .qk_nope_head_dim = 128,
                 .v_head_dim = 128}},
      // deepseek-ai/DeepSeek-R1: the DeepSeek-V3 architecture; same config fields and values.
      {"deepseek-r1", "DeepSeek",
       ModelSpec{.attention = AttentionKind::kMla,
                 .num_layers = 61,
                 .num_heads = 128,
                 .kv_lora_rank = 512,
                 .rope_dim = 64,
                 .qk_nope_head_dim = 128,
                 .v_head_dim = 128}},
      // deepseek-ai/DeepSeek-V2: num_hidden_layers 60, num_attention_heads 128,
      // kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128.
      // Full V2 has 60 layers; the 27 sometimes quoted for "V2" are V2-Lite's.
      {"deepseek-v2", "DeepSeek",
       ModelSpec{.attention = AttentionKind::kMla,
                 .num_layers = 60,
                 .num_heads = 128,
                 .kv_lora_rank = 512,
                 .rope_dim = 64,
                 .qk_nope_head_dim = 128,
                 .v_head_dim = 128}},
      // deepseek-ai/DeepSeek-V2-Lite: num_hidden_layers 27, num_attention_heads 16,
      // kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128.
      {"deepseek-v2-lite", "DeepSeek",
       ModelSpec{.attention = AttentionKind::kMla,
                 .num_layers = 27,
                 .num_heads = 16,
                 .kv_lora_rank = 512,
                 .rope_dim = 64,
                 .qk_nope_head_dim = 128,
                 .v_head_dim = 128}},
      // meta-llama/Meta-Llama-3-8B: num_hidden_layers 32, num_attention_heads 32,
      // num_key_value_heads 8, hidden_size 4096 (head_dim 4096 / 32 = 128).
      {"llama-3-8b", "Llama",
       ModelSpec{.attention = AttentionKind::kGqa,
                 .num_layers = 32,
                 .num_heads = 32,
                 .num_kv_heads = 8,
                 .head_dim = 128}},
      // meta-llama/Meta-Llama-3-70B: num_hidden_layers 80, num_attention_heads 64,
      // num_key_value_heads 8, hidden_size 8192 (head_dim 8192 / 64 = 128).
      {"llama-3-70b", "Llama",
       ModelSpec{.attention = AttentionKind::kGqa,
                 .num_layers = 80,
                 .num_heads = 64,
                 .num_kv_heads = 8,
                 .head_dim = 128}},
      // mistralai/Mistral-7B-v0.1: num_hidden_layers 32, num_attention_heads 32,
      // num_key_value_heads 8, hidden_size 4096 (head_dim 128).
      {"mistral-7b", "Mistral",
       ModelSpec{.attention = AttentionKind::kGqa,
                 .num_layers = 32,
                 .num_heads = 32,
                 .num_kv_heads = 8,
                 .head_dim = 128}},
      // meta-llama/Llama-2-7b-hf: num_hidden_layers 32, num_attention_heads 32,
      // num_key_value_heads 32 (plain MHA), hidden_size 4096 (head_dim 128).
      {"llama-2-7b", "Llama",
       ModelSpec{.attention = AttentionKind::kMha,
                 .num_layers = 32,
                 .num_heads = 32,
                 .num_kv_heads = 32,
                 .head_dim = 128}},
  };
  return kModels;
}

}  // namespace

std::span<const CatalogModel> Catalog() { return Models(); }

absl::StatusOr<ModelSpec> FindModel(absl::string_view name, KvDtype dtype) {
  for (const CatalogModel& m : Models()) {
    if (absl::EqualsIgnoreCase(m.name, name)) {
      ModelSpec spec = m.spec;
      spec.dtype = dtype;
      if (absl::Status s = spec.Validate(); !s.ok()) {
        return s;  // only an out-of-range dtype value gets here
      }
      return spec;
    }
  }
  std::vector<absl::string_view> known;
  for (const CatalogModel& m : Models()) {
    known.push_back(m.name);
  }
  return absl::NotFoundError(
      absl::StrCat("no model '", name, "' in the catalogue; known: ", absl::StrJoin(known, ", ")));
}

KvFootprint FootprintOf(const ModelSpec& spec) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  KvFootprint f;
  f.bytes_per_token_per_layer = spec.BytesPerTokenPerLayer();
  f.bytes_per_token = spec.BytesPerToken();
  f.bytes_per_page = spec.BytesPerPage();
  f.tokens_per_gib = kGiB / f.bytes_per_token;
  f.mha_shaped_ratio =
      static_cast<double>(spec.MhaShapedBytesPerToken()) / static_cast<double>(f.bytes_per_token);
  return f;
}

}  // namespace kvcm
