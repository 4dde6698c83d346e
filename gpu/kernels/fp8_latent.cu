// FP8 latent quantisation kernels: bit-identical to fp8_latent_cpu.cc (same helpers; the
// group maximum is order-independent and x / scale is an IEEE division in both).
//
// Launch geometry (both kernels): one CTA of 128 threads per token, grid (num_tokens).
//   quantise:   warp g handles latent group g (128 latents): lane l reads latents
//               g*128 + 4l .. 4l+3 (8 bytes), the warp reduces the group's max |x| with
//               shuffles, every lane writes its 4 e4m3 bytes, lane 0 the group's scale
//   dequantise: thread i handles latents 4i .. 4i+3 (group i / 32)
//   rope:       threads 0..31 copy the 64 bf16 rope dims as 32 4-byte words
#include <cuda_runtime.h>

#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/mla_decode.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {
namespace {

__global__ void __launch_bounds__(128) QuantizeLatentsFp8Kernel(const uint16_t* in, uint8_t* out) {
  const int64_t t = blockIdx.x;
  const uint16_t* src = in + t * kMlaHeadDim;
  uint8_t* dst = out + t * kFp8TokenBytes;
  const int group = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int d0 = group * kFp8GroupSize + 4 * lane;
  const uint2 w = *reinterpret_cast<const uint2*>(src + d0);
  const float x[4] = {Bf16ToFloat(static_cast<uint16_t>(w.x & 0xffffu)),
                      Bf16ToFloat(static_cast<uint16_t>(w.x >> 16)),
                      Bf16ToFloat(static_cast<uint16_t>(w.y & 0xffffu)),
                      Bf16ToFloat(static_cast<uint16_t>(w.y >> 16))};
  float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float scale = Fp8GroupScale(amax);
  const uint32_t packed =
      uint32_t{QuantizeFp8(x[0], scale)} | (uint32_t{QuantizeFp8(x[1], scale)} << 8) |
      (uint32_t{QuantizeFp8(x[2], scale)} << 16) | (uint32_t{QuantizeFp8(x[3], scale)} << 24);
  *reinterpret_cast<uint32_t*>(dst + d0) = packed;
  if (lane == 0) *reinterpret_cast<float*>(dst + kFp8ScalesOffset + 4 * group) = scale;
  if (threadIdx.x < 32) {
    reinterpret_cast<uint32_t*>(dst + kFp8RopeOffset)[threadIdx.x] =
        reinterpret_cast<const uint32_t*>(src + kMlaLatentDim)[threadIdx.x];
  }
}

__global__ void __launch_bounds__(128)
    DequantizeLatentsFp8Kernel(const uint8_t* in, uint16_t* out) {
  const int64_t t = blockIdx.x;
  const uint8_t* src = in + t * kFp8TokenBytes;
  uint16_t* dst = out + t * kMlaHeadDim;
  const int d0 = 4 * threadIdx.x;
  const float scale = Fp8TokenScale(src, d0 / kFp8GroupSize);
  const uint32_t w = *reinterpret_cast<const uint32_t*>(src + d0);
  uint16_t y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    y[i] = FloatToBf16(DequantizeFp8(static_cast<uint8_t>((w >> (8 * i)) & 0xffu), scale));
  }
  *reinterpret_cast<uint2*>(dst + d0) =
      make_uint2(uint32_t{y[0]} | (uint32_t{y[1]} << 16), uint32_t{y[2]} | (uint32_t{y[3]} << 16));
  if (threadIdx.x < 32) {
    reinterpret_cast<uint32_t*>(dst + kMlaLatentDim)[threadIdx.x] =
        reinterpret_cast<const uint32_t*>(src + kFp8RopeOffset)[threadIdx.x];
  }
}

}  // namespace

cudaError_t LaunchQuantizeLatentsFp8(const uint16_t* in, int64_t num_tokens, uint8_t* out,
                                     cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  QuantizeLatentsFp8Kernel<<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(in, out);
  return cudaGetLastError();
}

cudaError_t LaunchDequantizeLatentsFp8(const uint8_t* in, int64_t num_tokens, uint16_t* out,
                                       cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  DequantizeLatentsFp8Kernel<<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(in, out);
  return cudaGetLastError();
}

}  // namespace kvcm::gpu
