// A small catalogue of well-known models with the KV geometry of their published configs,
// so that a spec can be asked for by name ("deepseek-v3") instead of typed in dimension by
// dimension, and what each model costs per token can be listed side by side.
#ifndef KVCM_COMMON_MODEL_CATALOG_H_
#define KVCM_COMMON_MODEL_CATALOG_H_

#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"

namespace kvcm {

// One named model. `spec` holds the dimensions only: its dtype is bf16 and its page size
// kDefaultPageSizeTokens; FindModel() sets the dtype asked for.
struct CatalogModel {
  absl::string_view name;    // lower-case, as on the command line: "deepseek-v3"
  absl::string_view family;  // "DeepSeek", "Llama", "Mistral"
  ModelSpec spec;
};

// Every catalogue entry, in a fixed order (DeepSeek MLA models first). Each entry's spec
// passes Validate() in every dtype. The storage is static; safe to call concurrently.
std::span<const CatalogModel> Catalog();

// The spec of the model called `name` (case-insensitive) with `dtype` as its KV element
// type and the default page size. NOT_FOUND listing the known names when there is none.
absl::StatusOr<ModelSpec> FindModel(absl::string_view name, KvDtype dtype = KvDtype::kBf16);

// What one spec costs, in the units a pool is sized in.
struct KvFootprint {
  uint64_t bytes_per_token_per_layer = 0;
  uint64_t bytes_per_token = 0;  // all layers
  uint64_t bytes_per_page = 0;   // page_size_tokens tokens
  // floor(2^30 / bytes_per_token): tokens of KV one GiB holds, ignoring page rounding.
  uint64_t tokens_per_gib = 0;
  // MhaShapedBytesPerToken() / bytes_per_token: how many times more a cache that stores
  // full per-head K and V would charge. MLA: ~71 for DeepSeek-V3 in bf16; GQA:
  // num_heads / num_kv_heads (less with int8 scales); MHA: 1.
  double mha_shaped_ratio = 0;
};

// REQUIRES: spec.Validate().ok().
KvFootprint FootprintOf(const ModelSpec& spec);

}  // namespace kvcm

#endif  // KVCM_COMMON_MODEL_CATALOG_H_
