// MLA decode attention kernel template (instantiated in mla_decode_bf16.cu and
// mla_decode_fp8.cu). CUDA cores only, fp32 accumulation.
//
// Launch geometry:
//   grid  (ceil(num_heads / kHeadsPerCta), batch): one CTA per (sequence, group of 4 heads)
//   block kWarps * 32 = 128 threads; warp w takes tokens w, w + 4, w + 8, ... of the
//         sequence (the warps split the sequence), each keeping its own online-softmax state
//         for the CTA's 4 heads
//   lane  l owns the dims {2l, 2l + 1} + 64 j, j = 0..8 (j = 8: the rope dims), so one
//         warp-wide 4-byte load of a bf16 token row reads 128 contiguous bytes, and the same
//         registers serve the score (all 576 dims, reduced across the warp with shuffles)
//         and the value update (the lane's 16 latent dims)
//   end   the 4 warps' partial states meet in shared memory (32 KiB) and are merged with
//         SoftmaxMerge: thread i writes dims 4i..4i+3 of each head
// Registers: q 4 x 18, acc 4 x 16, k 18 floats per lane. Every per-element step (bf16 / e4m3
// widening, dot, online softmax, merge) is the mla_math.h helper the CPU twin uses.
#ifndef KVCM_GPU_KERNELS_MLA_DECODE_CUH_
#define KVCM_GPU_KERNELS_MLA_DECODE_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/mla_decode.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {

inline constexpr int kMlaWarps = 4;
inline constexpr int kMlaHeadsPerCta = 4;
inline constexpr int kMlaLaneDims = kMlaHeadDim / 32;       // 18
inline constexpr int kMlaLaneLatents = kMlaLatentDim / 32;  // 16

// Token loaders: lane's 18 dims of one token (latents first, then 2 rope dims), as fp32.
struct Bf16Latents {
  static constexpr int kTokenBytes = kBf16TokenBytes;
  __device__ static void Load(const uint8_t* token, int lane, float* k) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(token);
#pragma unroll
    for (int j = 0; j < 9; ++j) {
      const uint32_t w = __ldg(row + lane + 32 * j);
      k[2 * j] = Bf16ToFloat(static_cast<uint16_t>(w & 0xffffu));
      k[2 * j + 1] = Bf16ToFloat(static_cast<uint16_t>(w >> 16));
    }
  }
};

struct Fp8Latents {
  static constexpr int kTokenBytes = kFp8TokenBytes;
  __device__ static void Load(const uint8_t* token, int lane, float* k) {
    const uint16_t* lat = reinterpret_cast<const uint16_t*>(token);
    const float4 s = __ldg(reinterpret_cast<const float4*>(token + kFp8ScalesOffset));
    const float scale[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // dims 2 lane + 64 j lie in group j / 2
      const uint16_t w = __ldg(lat + lane + 32 * j);
      k[2 * j] = DequantizeFp8(static_cast<uint8_t>(w & 0xffu), scale[j / 2]);
      k[2 * j + 1] = DequantizeFp8(static_cast<uint8_t>(w >> 8), scale[j / 2]);
    }
    const uint32_t r = __ldg(reinterpret_cast<const uint32_t*>(token + kFp8RopeOffset) + lane);
    k[16] = Bf16ToFloat(static_cast<uint16_t>(r & 0xffffu));
    k[17] = Bf16ToFloat(static_cast<uint16_t>(r >> 16));
  }
};

template <typename Latents>
__global__ void __launch_bounds__(kMlaWarps * 32) MlaDecodeKernel(const MlaDecodeParams p) {
  __shared__ float red_acc[kMlaWarps][kMlaHeadsPerCta][kMlaLatentDim];
  __shared__ SoftmaxState red_state[kMlaWarps][kMlaHeadsPerCta];

  const int b = blockIdx.y;
  const int head0 = blockIdx.x * kMlaHeadsPerCta;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  float q[kMlaHeadsPerCta][kMlaLaneDims];
#pragma unroll
  for (int h = 0; h < kMlaHeadsPerCta; ++h) {
    if (head0 + h < p.num_heads) {
      const uint32_t* qrow = reinterpret_cast<const uint32_t*>(p.q + b * p.q_batch_stride +
                                                               (head0 + h) * p.q_head_stride);
#pragma unroll
      for (int j = 0; j < 9; ++j) {
        const uint32_t w = __ldg(qrow + lane + 32 * j);
        q[h][2 * j] = Bf16ToFloat(static_cast<uint16_t>(w & 0xffffu));
        q[h][2 * j + 1] = Bf16ToFloat(static_cast<uint16_t>(w >> 16));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kMlaLaneDims; ++i) q[h][i] = 0.0f;
    }
  }

  float acc[kMlaHeadsPerCta][kMlaLaneLatents];
  SoftmaxState st[kMlaHeadsPerCta];
#pragma unroll
  for (int h = 0; h < kMlaHeadsPerCta; ++h) {
    st[h] = EmptySoftmaxState();
#pragma unroll
    for (int i = 0; i < kMlaLaneLatents; ++i) acc[h][i] = 0.0f;
  }

  const int len = p.seq_lens[b];
  const int32_t* table = p.block_table + b * p.block_table_stride;
  const uint8_t* cache = static_cast<const uint8_t*>(p.kv_cache);
  for (int t = warp; t < len; t += kMlaWarps) {
    const int64_t block = table[t / p.page_size];
    const uint8_t* token =
        cache + block * p.kv_block_stride_bytes + int64_t{t % p.page_size} * Latents::kTokenBytes;
    float k[kMlaLaneDims];
    Latents::Load(token, lane, k);
#pragma unroll
    for (int h = 0; h < kMlaHeadsPerCta; ++h) {
      float s = Dot(q[h], k, kMlaLaneDims);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
      s *= p.softmax_scale;
      // s is the same in every lane, so this branch is warp-uniform; the maximum rarely moves
      // after the first tokens, so the 16-wide rescale is rare.
      const float alpha = SoftmaxRaiseMax(st[h], s);
      if (alpha != 1.0f) {
#pragma unroll
        for (int i = 0; i < kMlaLaneLatents; ++i) acc[h][i] *= alpha;
      }
      ScaleAndAxpy(acc[h], 1.0f, SoftmaxAccept(st[h], s), k, kMlaLaneLatents);
    }
  }

#pragma unroll
  for (int h = 0; h < kMlaHeadsPerCta; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      red_acc[warp][h][2 * lane + 64 * j] = acc[h][2 * j];
      red_acc[warp][h][2 * lane + 64 * j + 1] = acc[h][2 * j + 1];
    }
    if (lane == 0) red_state[warp][h] = st[h];
  }
  __syncthreads();

  const int d0 = threadIdx.x * 4;  // 128 threads x 4 dims = 512
#pragma unroll
  for (int h = 0; h < kMlaHeadsPerCta; ++h) {
    if (head0 + h >= p.num_heads) break;
    SoftmaxState merged = EmptySoftmaxState();
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int w = 0; w < kMlaWarps; ++w) {
      float scale_merged, scale_w;
      SoftmaxMerge(merged, red_state[w][h], &scale_merged, &scale_w);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = o[i] * scale_merged + scale_w * red_acc[w][h][d0 + i];
    }
    const float inv = SoftmaxInvSum(merged);
    uint16_t* out = p.out + b * p.out_batch_stride + (head0 + h) * p.out_head_stride + d0;
    const uint2 packed = make_uint2(
        static_cast<uint32_t>(FloatToBf16(o[0] * inv)) | (uint32_t{FloatToBf16(o[1] * inv)} << 16),
        static_cast<uint32_t>(FloatToBf16(o[2] * inv)) | (uint32_t{FloatToBf16(o[3] * inv)} << 16));
    *reinterpret_cast<uint2*>(out) = packed;
    if (threadIdx.x == 0 && p.lse != nullptr)
      p.lse[b * p.num_heads + head0 + h] = SoftmaxLse(merged);
  }
}

template <typename Latents>
cudaError_t LaunchMlaDecodeKernel(const MlaDecodeParams& p, cudaStream_t stream) {
  const dim3 grid((p.num_heads + kMlaHeadsPerCta - 1) / kMlaHeadsPerCta, p.batch);
  MlaDecodeKernel<Latents><<<grid, kMlaWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_MLA_DECODE_CUH_
