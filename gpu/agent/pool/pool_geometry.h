// PoolGeometry: how an agent's pool is carved into fixed-size blocks.
//
// One block holds one page (spec.page_size_tokens tokens) of EVERY layer of the model. This
// makes a block id exactly what CacheManager.Insert records for a page, and bytes_per_block
// exactly the manager's bytes_per_page for the namespace (ModelSpec::BytesPerPage), so the
// agent's and the manager's byte accounting agree to the byte. Inside a block the layers
// are outermost; layer l of block b starts at b * bytes_per_block + l * bytes_per_layer_page,
// so a kernel sees one layer of the whole pool as a strided view with block stride
// bytes_per_block:
//   MLA bf16/fp16  [num_blocks, num_layers, page_size, kv_lora_rank + rope_dim]  (576 for
//                  DeepSeek-V3: per layer, FlashMLA's [num_blocks, page_size, 576])
//   MLA fp8        [num_blocks, num_layers, page_size, 656] bytes: FlashMLA's 512 fp8 +
//                  4 fp32 scales + 64 bf16 rope per token per layer
//   MHA/MQA/GQA    [num_blocks, num_layers, 2, kv_heads, page_size, head_dim]  (K then V)
//   int8 (any)     [num_blocks, num_layers, page_size, bytes_per_token_per_layer] bytes
//                  (values and their fp32 scales).
// Plain value type.
#ifndef KVCM_GPU_AGENT_POOL_POOL_GEOMETRY_H_
#define KVCM_GPU_AGENT_POOL_POOL_GEOMETRY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace kvcm {

// The shape of the pool as a kernel indexes it; product(shape) * element_bytes is the
// pool's size in bytes.
struct BlockLayout {
  std::vector<uint64_t> shape;  // outermost first; shape[0] is num_blocks
  uint32_t element_bytes = 0;
  std::string ToString() const;  // "[num_blocks=8, layers=61, page=64, 576] x 2 B"
};

struct PoolGeometry {
  // What a block holds. Must pass ModelSpec::Validate().
  ModelSpec spec;
  // Blocks in the pool. 1..kMaxBlocks.
  uint64_t num_blocks = 0;

  // A BlockId is 32 bits and kPendingBlock (2^32 - 1) is reserved.
  static constexpr uint64_t kMaxBlocks = 0xFFFFFFFEull;

  // The largest pool of `spec` blocks that fits in `capacity_bytes` (whole blocks; the
  // remainder is unused). INVALID_ARGUMENT as Validate(), "capacity_bytes" when it holds
  // no block.
  static absl::StatusOr<PoolGeometry> ForCapacity(const ModelSpec& spec, uint64_t capacity_bytes);

  // INVALID_ARGUMENT naming the field: "geometry.spec.<field>" for an impossible spec,
  // "geometry.num_blocks" out of range or when the pool's bytes overflow 64 bits.
  absl::Status Validate() const;

  // REQUIRES: Validate().ok() for the three below.
  uint64_t bytes_per_block() const { return spec.BytesPerPage(); }
  uint64_t pool_bytes() const { return bytes_per_block() * num_blocks; }
  BlockLayout Layout() const;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_POOL_GEOMETRY_H_
