// MLA decode attention over one layer of a BlockPool's own blocks: the core of the
// BlockAgent RunAttention RPC (for tests and validation), with no gRPC in it.
//
// The pool must hold MLA latents (bf16, or FlashMLA's fp8 layout). Layer `layer` of the
// pool is the kernels' paged cache [num_blocks, page_size, token bytes] with block stride
// bytes_per_block (see pool_geometry.h), so the kernel reads the blocks in place.
// Thread-safe (stateless); runs under the pool's lock, so concurrent writes and frees wait.
#ifndef KVCM_GPU_AGENT_POOL_ATTENTION_H_
#define KVCM_GPU_AGENT_POOL_ATTENTION_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/agent/block_pool.h"
#include "server/core/types.h"

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

  static constexpr size_t kMaxBatch = 1024;
  static constexpr uint32_t kMaxHeads = 128;
};

struct PoolAttentionResult {
  std::vector<float> output;  // [batch, num_heads, kv_lora_rank], widened from the kernel's bf16
  std::vector<float> lse;     // [batch, num_heads], natural log of the scaled scores
};

// INVALID_ARGUMENT naming the field for a bad request, a pool that is not MLA bf16/fp8
// ("pool"), or what ValidateMlaDecodeParams refuses; FAILED_PRECONDITION "block_table" for
// a block not allocated to owner_epoch; UNIMPLEMENTED on a device backend (only the CPU
// kernel over host memory is wired here; a CUDA pool would need MlaDecodeCuda).
absl::StatusOr<PoolAttentionResult> RunMlaDecodeOnPool(const BlockPool& pool,
                                                       const PoolAttentionRequest& req);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_ATTENTION_H_
