// MLA decode attention over one layer of a BlockPool's own blocks: the core of the
// BlockAgent RunAttention RPC (for tests and validation), with no gRPC in it.
//
// The pool must hold MLA latents (bf16, or FlashMLA's fp8 layout). Layer `layer` of the
// pool is the kernels' paged cache [num_blocks, page_size, token bytes] with block stride
// bytes_per_block (see pool_geometry.h), so the kernel reads the blocks in place: the CPU
// kernel (MlaDecodeCpu) on a host pool, the CUDA kernel (MlaDecodeCuda) on a device pool.
// Both get the same params after the same checks; their outputs agree to about one bf16
// ulp (fp32 sums in different orders).
// Thread-safe (stateless); runs under the pool's lock (BlockPool::WithOwnedArena), so
// concurrent writes and frees wait, on a device pool until the kernel has finished.
#ifndef KVCM_GPU_AGENT_POOL_POOL_ATTENTION_H_
#define KVCM_GPU_AGENT_POOL_POOL_ATTENTION_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/types.h"
#include "gpu/agent/pool/block_pool.h"

namespace kvcm {

struct PoolAttentionRequest {
  // Blocks of each sequence in token order; batch = block_table.size(), 1..kMaxBatch.
  std::vector<std::vector<BlockId>> block_table;
  // Tokens per sequence, 1..(blocks listed x page_size_tokens); one per sequence.
  std::vector<uint32_t> seq_lens;
  // [batch, num_heads, kv_lora_rank + rope_dim] bf16, little-endian, row-major.
  std::span<const std::byte> query_bf16;
  float softmax_scale = 0.0f;  // finite, > 0
  uint32_t num_heads = 0;      // 1..kMaxHeads
  uint32_t layer = 0;          // < spec.num_layers
  uint64_t owner_epoch = 0;    // every listed block must be allocated to it
  // Parallel to block_table (row by row), the generation each block was allocated in,
  // checked under the lock the kernel runs under (ABORTED for an allocation that ended);
  // empty: not checked.
  std::vector<std::vector<uint64_t>> block_generations;

  static constexpr size_t kMaxBatch = 1024;
  static constexpr uint32_t kMaxHeads = 128;
};

struct PoolAttentionResult {
  std::vector<float> output;  // [batch, num_heads, kv_lora_rank], widened from the kernel's bf16
  std::vector<float> lse;     // [batch, num_heads], natural log of the scaled scores
};

// INVALID_ARGUMENT naming the field for a bad request, a pool that is not MLA bf16/fp8
// ("pool"), or what ValidateMlaDecodeParams (and, on a device pool, MlaDecodeCuda) refuses;
// FAILED_PRECONDITION "block_table" for a block not allocated to owner_epoch. On a device
// pool: a CUDA error as a Status (gpu/kernels/cuda_status.h), and UNIMPLEMENTED in a build
// without CUDA (only a fake device backend can get there). The device path copies the query,
// block table and seq_lens to device memory allocated per call (see pool_attention_cuda.h).
absl::StatusOr<PoolAttentionResult> RunMlaDecodeOnPool(const BlockPool& pool,
                                                       const PoolAttentionRequest& req);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_POOL_ATTENTION_H_
