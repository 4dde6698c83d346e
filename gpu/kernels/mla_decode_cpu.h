// MLA decode attention on the CPU: the reference the CUDA kernel is checked against, and
// the implementation used where no GPU exists. Same params as the CUDA launcher, with host
// pointers; same per-element helpers (mla_math.h, fp8_latent.h). Single-threaded.
// Thread-safe: the functions keep no state; concurrent calls must not share `out`/`lse`.
#ifndef KVCM_GPU_KERNELS_MLA_DECODE_CPU_H_
#define KVCM_GPU_KERNELS_MLA_DECODE_CPU_H_

#include <stdint.h>

#include "absl/status/status.h"
#include "gpu/kernels/mla_decode_params.h"

namespace kvcm::gpu {

// The API-layer check every launcher runs before a kernel (kernels trust their inputs).
// Returns INVALID_ARGUMENT naming the offending field: null pointers, non-positive shapes,
// page_size 0, kv_lora_rank != 512 or rope_dim != 64 for fp8, strides too small, a seq_len
// negative or above max_blocks_per_seq * page_size, a block id outside [0, num_blocks).
// `host_block_table` and `host_seq_lens` are host copies of p.block_table / p.seq_lens (for
// the CPU path, those pointers themselves); the other pointers are only checked for null.
absl::Status ValidateMlaDecodeParams(const MlaDecodeParams& p, const int32_t* host_block_table,
                                     const int32_t* host_seq_lens);

// Validates (all pointers are host pointers) and runs MlaDecodeCpuUnchecked.
absl::Status MlaDecodeCpu(const MlaDecodeParams& p);

// REQUIRES: ValidateMlaDecodeParams(p, p.block_table, p.seq_lens).ok().
// Per sequence: walks its blocks in order, widens each block's tokens to fp32 once, and for
// every head scores the block, raises the running maximum once per block and accumulates.
void MlaDecodeCpuUnchecked(const MlaDecodeParams& p);

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_MLA_DECODE_CPU_H_
