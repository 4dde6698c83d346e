// FlashMLA's FP8 latent layout and the per-element helpers that quantise into it and back,
// shared by the CUDA kernels (fp8_latent.cu, mla_decode.cuh) and the CPU twins.
//
// One token, 656 bytes:
//   [0, 512)    512 latents, fp8 e4m3, each the latent divided by its group's scale
//   [512, 528)  4 fp32 scales, one per group of 128 latents (scale = group amax / 448)
//   [528, 656)  64 rope dims, bf16, copied unquantised
#ifndef KVCM_GPU_KERNELS_FP8_LATENT_H_
#define KVCM_GPU_KERNELS_FP8_LATENT_H_

#include <stdint.h>

#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {

inline constexpr int kFp8GroupSize = 128;                                    // latents per scale
inline constexpr int kFp8NumScales = kMlaLatentDim / kFp8GroupSize;          // 4
inline constexpr int kFp8ScalesOffset = kMlaLatentDim;                       // bytes: 512
inline constexpr int kFp8RopeOffset = kFp8ScalesOffset + kFp8NumScales * 4;  // bytes: 528
inline constexpr int kFp8TokenBytes = kFp8RopeOffset + kMlaRopeDim * 2;      // bytes: 656
inline constexpr int kBf16TokenBytes = kMlaHeadDim * 2;                      // bytes: 1152

// Scale of one group from its largest magnitude; an all-zero group gets 1 so that it
// dequantises to exact zeros.
KVCM_HD inline float Fp8GroupScale(float amax) { return amax > 0.0f ? amax / kE4m3Max : 1.0f; }

KVCM_HD inline uint8_t QuantizeFp8(float x, float scale) { return FloatToE4m3(x / scale); }

KVCM_HD inline float DequantizeFp8(uint8_t v, float scale) { return E4m3ToFloat(v) * scale; }

KVCM_HD inline float Fp8TokenScale(const uint8_t* token, int group) {
  float s;
  memcpy(&s, token + kFp8ScalesOffset + 4 * group, sizeof(s));
  return s;
}

KVCM_HD inline uint16_t Fp8TokenRope(const uint8_t* token, int i) {
  uint16_t r;
  memcpy(&r, token + kFp8RopeOffset + 2 * i, sizeof(r));
  return r;
}

// Latent (i < 512) or rope (512 <= i < 576) dim i of one fp8 token, as float.
KVCM_HD inline float Fp8TokenDim(const uint8_t* token, int i) {
  if (i < kMlaLatentDim) return DequantizeFp8(token[i], Fp8TokenScale(token, i / kFp8GroupSize));
  return Bf16ToFloat(Fp8TokenRope(token, i - kMlaLatentDim));
}

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_FP8_LATENT_H_
