// CUDA launchers for MLA decode attention (mla_decode.cuh) and the FP8 latent kernels
// (fp8_latent.cu). They trust their inputs and return the launch's cudaError_t;
// mla_decode_api.h validates and converts to absl::Status. All pointers are device pointers;
// the work is queued on `stream` and nothing is allocated.
#ifndef KVCM_GPU_KERNELS_MLA_DECODE_H_
#define KVCM_GPU_KERNELS_MLA_DECODE_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "gpu/kernels/mla_decode_params.h"

namespace kvcm::gpu {

// REQUIRES: ValidateMlaDecodeParams(p, ...) ok, kv_lora_rank 512, rope_dim 64, every row and
// block 4-byte aligned. Dispatches on p.dtype to the per-dtype instantiations below.
cudaError_t LaunchMlaDecode(const MlaDecodeParams& p, cudaStream_t stream);
cudaError_t LaunchMlaDecodeBf16(const MlaDecodeParams& p, cudaStream_t stream);
cudaError_t LaunchMlaDecodeFp8(const MlaDecodeParams& p, cudaStream_t stream);

// in: [num_tokens, 576] bf16 bits; out: [num_tokens, 656] bytes (fp8_latent.h). 8-byte aligned.
cudaError_t LaunchQuantizeLatentsFp8(const uint16_t* in, int64_t num_tokens, uint8_t* out,
                                     cudaStream_t stream);
// in: [num_tokens, 656] bytes; out: [num_tokens, 576] bf16 bits. 8-byte aligned.
cudaError_t LaunchDequantizeLatentsFp8(const uint8_t* in, int64_t num_tokens, uint16_t* out,
                                       cudaStream_t stream);

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_MLA_DECODE_H_
