// The MLA model spec the RPC tests register: DeepSeek-V3 from the model catalogue, as the
// wire carries it. Header-only, test code.
#ifndef KVCM_TESTS_UTIL_MLA_SPEC_H_
#define KVCM_TESTS_UTIL_MLA_SPEC_H_

#include <cstdint>

#include "common/model_catalog.h"
#include "common/model_spec.h"
#include "kvcm/v1/common.pb.h"
#include "proto/core_types.h"

namespace kvcm::testing {

// DeepSeek-V3's latent in bf16 (61 layers of 512 + 64: 70,272 B per token) in
// `page_size_tokens`-token pages, no kv_layout stated.
inline v1::ModelSpec MlaSpecProto(uint32_t page_size_tokens) {
  ModelSpec spec = FindModel("deepseek-v3").value();
  spec.page_size_tokens = page_size_tokens;
  v1::ModelSpec out;
  ModelSpecToProto(spec, &out);
  return out;
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_MLA_SPEC_H_
