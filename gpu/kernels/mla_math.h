// Per-element math shared by the CUDA kernels and their CPU twins: bf16 and fp8 e4m3
// conversions (in software, so that host and device agree bit for bit), the online-softmax
// state and its merge, and dot products. Compiles with g++ (no CUDA headers) and with nvcc.
#ifndef KVCM_GPU_KERNELS_MLA_MATH_H_
#define KVCM_GPU_KERNELS_MLA_MATH_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define KVCM_HD __host__ __device__
#else
#define KVCM_HD
#endif

namespace kvcm::gpu {

// MLA latent geometry (DeepSeek-V2/V3): every token caches one vector of kv_lora_rank
// latents followed by rope_dim rotary dims; keys use all of it, values the latent part.
inline constexpr int kMlaLatentDim = 512;  // kv_lora_rank
inline constexpr int kMlaRopeDim = 64;
inline constexpr int kMlaHeadDim = kMlaLatentDim + kMlaRopeDim;  // 576

KVCM_HD inline uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

KVCM_HD inline float BitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// bf16 is stored as its raw 16 bits (uint16_t) on both sides; widening is exact.
KVCM_HD inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even (what __float2bfloat16_rn does); NaN stays a quiet NaN.
KVCM_HD inline uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

// fp8 e4m3 ("fn": OCP FP8, no infinities): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
// Largest finite magnitude 448 (0x7e); 0x7f / 0xff are NaN; subnormals are m * 2^-9.
inline constexpr float kE4m3Max = 448.0f;

KVCM_HD inline float E4m3ToFloat(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t mant = v & 0x7u;
  if (exp == 0xfu && mant == 0x7u) return BitsToFloat(sign | 0x7fc00000u);
  if (exp == 0) {  // zero or subnormal: exact in float
    return BitsToFloat(sign | FloatBits(static_cast<float>(mant) * 0.001953125f));
  }
  return BitsToFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}

// Round to nearest, ties to even, saturating to +-448 (as __nv_cvt_float_to_fp8 with
// __NV_SATFINITE); NaN becomes 0x7f.
KVCM_HD inline uint8_t FloatToE4m3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 0x7f;
  const float a = BitsToFloat(abs_bits);
  if (a < 0.015625f) {  // below 2^-6, the smallest normal: quantum 2^-9
    // a * 512 is exact; rintf rounds ties to even. 8 lands on 0x08 = 2^-6, the right code.
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(a * 512.0f)));
  }
  // Keep 3 mantissa bits with ties-to-even on the float bits; a carry bumps the exponent.
  const uint32_t r = (abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20;
  uint32_t code = r - (120u << 3);  // rebias the exponent from 127 to 7
  if (code > 0x7eu) code = 0x7eu;   // also catches +inf
  return static_cast<uint8_t>(sign | code);
}

// Online softmax over scaled scores. `max` is the running maximum, `sum` the sum of
// exp(score - max). An empty state has max = -inf and sum = 0.
struct SoftmaxState {
  float max;
  float sum;
};

KVCM_HD inline SoftmaxState EmptySoftmaxState() { return SoftmaxState{-INFINITY, 0.0f}; }

// Raises the running maximum to at least `new_max` (finite). Returns the factor by which
// every accumulator built so far must be multiplied (1 when the maximum did not move).
KVCM_HD inline float SoftmaxRaiseMax(SoftmaxState& st, float new_max) {
  if (!(new_max > st.max)) return 1.0f;
  const float alpha = st.max == -INFINITY ? 0.0f : expf(st.max - new_max);
  st.sum *= alpha;
  st.max = new_max;
  return alpha;
}

// Weight of one score under the current maximum; adds it to the sum.
// REQUIRES: score <= st.max (call SoftmaxRaiseMax first).
KVCM_HD inline float SoftmaxAccept(SoftmaxState& st, float score) {
  const float p = expf(score - st.max);
  st.sum += p;
  return p;
}

// Folds `other` into `into`; the accumulators of each side must be multiplied by
// *scale_into and *scale_other respectively and then added. Empty states are handled.
KVCM_HD inline void SoftmaxMerge(SoftmaxState& into, const SoftmaxState& other, float* scale_into,
                                 float* scale_other) {
  if (other.max == -INFINITY) {
    *scale_into = 1.0f;
    *scale_other = 0.0f;
    return;
  }
  if (into.max == -INFINITY) {
    *scale_into = 0.0f;
    *scale_other = 1.0f;
    into = other;
    return;
  }
  const float m = into.max > other.max ? into.max : other.max;
  *scale_into = expf(into.max - m);
  *scale_other = expf(other.max - m);
  into.sum = into.sum * *scale_into + other.sum * *scale_other;
  into.max = m;
}

// 1 / sum, or 0 for an empty state (a zero-length sequence yields a zero output).
KVCM_HD inline float SoftmaxInvSum(const SoftmaxState& st) {
  return st.sum > 0.0f ? 1.0f / st.sum : 0.0f;
}

// Natural log of sum_t exp(score_t): -inf for an empty state.
KVCM_HD inline float SoftmaxLse(const SoftmaxState& st) {
  return st.sum > 0.0f ? st.max + logf(st.sum) : -INFINITY;
}

// Dot product of n floats with 8 independent partial sums (a fixed summation order, and
// one the host compiler can keep in vector registers without -ffast-math).
KVCM_HD inline float Dot(const float* a, const float* b, int n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) part[0] += a[i] * b[i];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// acc[i] = acc[i] * alpha + p * v[i] for n values (the value update of one token).
KVCM_HD inline void ScaleAndAxpy(float* acc, float alpha, float p, const float* v, int n) {
  for (int i = 0; i < n; ++i) acc[i] = acc[i] * alpha + p * v[i];
}

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_MLA_MATH_H_
