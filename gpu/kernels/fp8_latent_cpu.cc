#include "gpu/kernels/fp8_latent_cpu.h"

#include <math.h>
#include <string.h>

#include "gpu/kernels/fp8_latent.h"

namespace kvcm::gpu {

void QuantizeLatentsFp8Cpu(const uint16_t* in, int64_t num_tokens, uint8_t* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const uint16_t* src = in + t * kMlaHeadDim;
    uint8_t* dst = out + t * kFp8TokenBytes;
    for (int g = 0; g < kFp8NumScales; ++g) {
      float amax = 0.0f;
      for (int i = 0; i < kFp8GroupSize; ++i) {
        amax = fmaxf(amax, fabsf(Bf16ToFloat(src[g * kFp8GroupSize + i])));
      }
      const float scale = Fp8GroupScale(amax);
      for (int i = 0; i < kFp8GroupSize; ++i) {
        const int d = g * kFp8GroupSize + i;
        dst[d] = QuantizeFp8(Bf16ToFloat(src[d]), scale);
      }
      memcpy(dst + kFp8ScalesOffset + 4 * g, &scale, sizeof(scale));
    }
    memcpy(dst + kFp8RopeOffset, src + kMlaLatentDim, kMlaRopeDim * sizeof(uint16_t));
  }
}

void DequantizeLatentsFp8Cpu(const uint8_t* in, int64_t num_tokens, uint16_t* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const uint8_t* src = in + t * kFp8TokenBytes;
    uint16_t* dst = out + t * kMlaHeadDim;
    for (int d = 0; d < kMlaLatentDim; ++d) {
      dst[d] = FloatToBf16(DequantizeFp8(src[d], Fp8TokenScale(src, d / kFp8GroupSize)));
    }
    memcpy(dst + kMlaLatentDim, src + kFp8RopeOffset, kMlaRopeDim * sizeof(uint16_t));
  }
}

}  // namespace kvcm::gpu
