#include "gpu/agent/pool/pool_geometry.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcm {

std::string BlockLayout::ToString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "] x ", element_bytes, " B");
}

absl::StatusOr<PoolGeometry> PoolGeometry::ForCapacity(const ModelSpec& spec,
                                                       uint64_t capacity_bytes) {
  PoolGeometry g;
  g.spec = spec;
  g.num_blocks = 1;
  if (absl::Status s = g.Validate(); !s.ok()) return s;
  const uint64_t per_block = g.bytes_per_block();
  if (capacity_bytes < per_block) {
    return absl::InvalidArgumentError(absl::StrCat("capacity_bytes ", capacity_bytes,
                                                   " holds no block of ", per_block, " bytes"));
  }
  g.num_blocks = capacity_bytes / per_block;
  if (absl::Status s = g.Validate(); !s.ok()) return s;
  return g;
}

absl::Status PoolGeometry::Validate() const {
  if (absl::Status s = spec.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.", s.message()));
  }
  if (num_blocks < 1 || num_blocks > kMaxBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.num_blocks must be in [1, ", kMaxBlocks, "], got ", num_blocks));
  }
  if (bytes_per_block() > std::numeric_limits<uint64_t>::max() / num_blocks) {
    return absl::InvalidArgumentError(
        "geometry.num_blocks times bytes per block overflows 64 bits");
  }
  return absl::OkStatus();
}

BlockLayout PoolGeometry::Layout() const {
  BlockLayout out;
  const uint64_t page = spec.page_size_tokens;
  const uint64_t layers = spec.num_layers;
  if (spec.dtype == KvDtype::kInt8 ||
      (spec.attention == AttentionKind::kMla && spec.dtype == KvDtype::kFp8)) {
    out.shape = {num_blocks, layers, page, spec.BytesPerTokenPerLayer()};
    out.element_bytes = 1;
    return out;
  }
  const uint32_t elem = spec.dtype == KvDtype::kFp8 ? 1 : 2;
  out.element_bytes = elem;
  if (spec.attention == AttentionKind::kMla) {
    out.shape = {num_blocks, layers, page, uint64_t{spec.kv_lora_rank} + spec.rope_dim};
  } else {
    const uint64_t kv_heads = spec.attention == AttentionKind::kMha   ? spec.num_heads
                              : spec.attention == AttentionKind::kMqa ? 1
                                                                      : spec.num_kv_heads;
    out.shape = {num_blocks, layers, 2, kv_heads, page, spec.head_dim};
  }
  return out;
}

}  // namespace kvcm
