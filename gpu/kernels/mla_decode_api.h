// absl::Status front of the CUDA kernels: validates (ValidateMlaDecodeParams plus what the
// CUDA kernel needs), launches, converts a CUDA error through KVCM_CUDA_RETURN_IF_ERROR.
// Asynchronous on `stream`; nothing is allocated. Thread-safe (stateless).
#ifndef KVCM_GPU_KERNELS_MLA_DECODE_API_H_
#define KVCM_GPU_KERNELS_MLA_DECODE_API_H_

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "absl/status/status.h"
#include "gpu/kernels/mla_decode_params.h"

namespace kvcm::gpu {

// p holds device pointers; host_block_table / host_seq_lens are host copies of
// p.block_table / p.seq_lens for the range checks. INVALID_ARGUMENT as
// ValidateMlaDecodeParams, and also for kv_lora_rank != 512, rope_dim != 64, or a stride that
// breaks the kernel's 4-byte (kv, q) / 8-byte (out) alignment.
absl::Status MlaDecodeCuda(const MlaDecodeParams& p, const int32_t* host_block_table,
                           const int32_t* host_seq_lens, cudaStream_t stream);

// Device pointers, shapes as fp8_latent_cpu.h. INVALID_ARGUMENT for null or misaligned
// (8-byte) pointers and a negative count.
absl::Status QuantizeLatentsFp8Cuda(const uint16_t* in, int64_t num_tokens, uint8_t* out,
                                    cudaStream_t stream);
absl::Status DequantizeLatentsFp8Cuda(const uint8_t* in, int64_t num_tokens, uint16_t* out,
                                      cudaStream_t stream);

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_MLA_DECODE_API_H_
