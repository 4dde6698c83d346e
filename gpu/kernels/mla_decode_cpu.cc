#include "gpu/kernels/mla_decode_cpu.h"

#include <math.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {
namespace {

absl::Status Bad(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("MlaDecodeParams.", field, ": ", why));
}

}  // namespace

absl::Status ValidateMlaDecodeParams(const MlaDecodeParams& p, const int32_t* host_block_table,
                                     const int32_t* host_seq_lens) {
  if (p.kv_cache == nullptr) return Bad("kv_cache", "null");
  if (p.block_table == nullptr || host_block_table == nullptr) return Bad("block_table", "null");
  if (p.seq_lens == nullptr || host_seq_lens == nullptr) return Bad("seq_lens", "null");
  if (p.q == nullptr) return Bad("q", "null");
  if (p.out == nullptr) return Bad("out", "null");
  if (p.batch <= 0) return Bad("batch", absl::StrCat(p.batch, " must be positive"));
  if (p.num_heads <= 0) return Bad("num_heads", absl::StrCat(p.num_heads, " must be positive"));
  if (p.num_blocks <= 0) return Bad("num_blocks", absl::StrCat(p.num_blocks, " must be positive"));
  if (p.page_size <= 0) return Bad("page_size", absl::StrCat(p.page_size, " must be positive"));
  if (p.max_blocks_per_seq <= 0) {
    return Bad("max_blocks_per_seq", absl::StrCat(p.max_blocks_per_seq, " must be positive"));
  }
  if (p.block_table_stride < p.max_blocks_per_seq) {
    return Bad("block_table_stride",
               absl::StrCat(p.block_table_stride, " < max_blocks_per_seq ", p.max_blocks_per_seq));
  }
  if (p.kv_lora_rank <= 0) return Bad("kv_lora_rank", "must be positive");
  if (p.rope_dim < 0) return Bad("rope_dim", "must not be negative");
  if (p.dtype == LatentDtype::kFp8E4m3) {
    if (p.kv_lora_rank != kMlaLatentDim) {
      return Bad("kv_lora_rank", absl::StrCat(p.kv_lora_rank, ": the fp8 layout needs 512"));
    }
    if (p.rope_dim != kMlaRopeDim) {
      return Bad("rope_dim", absl::StrCat(p.rope_dim, ": the fp8 layout needs 64"));
    }
  } else if (p.dtype != LatentDtype::kBf16) {
    return Bad("dtype", "unknown");
  }
  const int64_t head_dim = p.kv_lora_rank + p.rope_dim;
  if (p.kv_block_stride_bytes < p.page_size * MlaTokenBytes(p)) {
    return Bad("kv_block_stride_bytes",
               absl::StrCat(p.kv_block_stride_bytes, " < page_size * token bytes ",
                            p.page_size * MlaTokenBytes(p)));
  }
  if (p.q_head_stride < head_dim) return Bad("q_head_stride", "smaller than the head dim");
  if (p.q_batch_stride < p.num_heads * p.q_head_stride) {
    return Bad("q_batch_stride", "smaller than num_heads * q_head_stride");
  }
  if (p.out_head_stride < p.kv_lora_rank)
    return Bad("out_head_stride", "smaller than kv_lora_rank");
  if (p.out_batch_stride < p.num_heads * p.out_head_stride) {
    return Bad("out_batch_stride", "smaller than num_heads * out_head_stride");
  }
  if (!(p.softmax_scale > 0.0f) || !isfinite(p.softmax_scale)) {
    return Bad("softmax_scale", "must be positive and finite");
  }
  const int64_t max_tokens = int64_t{p.max_blocks_per_seq} * p.page_size;
  for (int b = 0; b < p.batch; ++b) {
    const int32_t len = host_seq_lens[b];
    if (len < 0 || len > max_tokens) {
      return Bad("seq_lens", absl::StrCat("seq_lens[", b, "] = ", len, " outside [0, ", max_tokens,
                                          "] (max_blocks_per_seq * page_size)"));
    }
    const int64_t used_blocks = (int64_t{len} + p.page_size - 1) / p.page_size;
    for (int64_t i = 0; i < used_blocks; ++i) {
      const int32_t id = host_block_table[b * p.block_table_stride + i];
      if (id < 0 || id >= p.num_blocks) {
        return Bad("block_table", absl::StrCat("block_table[", b, ", ", i, "] = ", id,
                                               " outside [0, num_blocks ", p.num_blocks, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status MlaDecodeCpu(const MlaDecodeParams& p) {
  if (absl::Status s = ValidateMlaDecodeParams(p, p.block_table, p.seq_lens); !s.ok()) return s;
  MlaDecodeCpuUnchecked(p);
  return absl::OkStatus();
}

void MlaDecodeCpuUnchecked(const MlaDecodeParams& p) {
  const int dim = p.kv_lora_rank + p.rope_dim;
  const int rank = p.kv_lora_rank;
  const int64_t token_bytes = MlaTokenBytes(p);
  const auto* cache = static_cast<const uint8_t*>(p.kv_cache);

  std::vector<float> k(static_cast<size_t>(p.page_size) * dim);     // [page_size, dim]
  std::vector<float> q(static_cast<size_t>(p.num_heads) * dim);     // [heads, dim]
  std::vector<float> acc(static_cast<size_t>(p.num_heads) * rank);  // [heads, rank]
  std::vector<SoftmaxState> state(p.num_heads);
  std::vector<float> score(p.page_size);

  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.num_heads; ++h) {
      const uint16_t* qh = p.q + b * p.q_batch_stride + h * p.q_head_stride;
      for (int d = 0; d < dim; ++d) q[h * dim + d] = Bf16ToFloat(qh[d]);
      state[h] = EmptySoftmaxState();
    }
    std::fill(acc.begin(), acc.end(), 0.0f);

    const int len = p.seq_lens[b];
    for (int first = 0; first < len; first += p.page_size) {
      const int32_t block = p.block_table[b * p.block_table_stride + first / p.page_size];
      const int rows = std::min(p.page_size, len - first);
      const uint8_t* base = cache + block * p.kv_block_stride_bytes;
      for (int j = 0; j < rows; ++j) {
        const uint8_t* token = base + j * token_bytes;
        float* kj = &k[static_cast<size_t>(j) * dim];
        if (p.dtype == LatentDtype::kFp8E4m3) {
          for (int d = 0; d < dim; ++d) kj[d] = Fp8TokenDim(token, d);
        } else {
          const auto* t16 = reinterpret_cast<const uint16_t*>(token);
          for (int d = 0; d < dim; ++d) kj[d] = Bf16ToFloat(t16[d]);
        }
      }
      for (int h = 0; h < p.num_heads; ++h) {
        const float* qh = &q[static_cast<size_t>(h) * dim];
        float tile_max = -INFINITY;
        for (int j = 0; j < rows; ++j) {
          score[j] = p.softmax_scale * Dot(qh, &k[static_cast<size_t>(j) * dim], dim);
          tile_max = std::max(tile_max, score[j]);
        }
        float* acc_h = &acc[static_cast<size_t>(h) * rank];
        const float alpha = SoftmaxRaiseMax(state[h], tile_max);
        if (alpha != 1.0f) {
          for (int d = 0; d < rank; ++d) acc_h[d] *= alpha;
        }
        for (int j = 0; j < rows; ++j) {
          const float w = SoftmaxAccept(state[h], score[j]);
          ScaleAndAxpy(acc_h, 1.0f, w, &k[static_cast<size_t>(j) * dim], rank);
        }
      }
    }

    for (int h = 0; h < p.num_heads; ++h) {
      const float inv = SoftmaxInvSum(state[h]);
      uint16_t* oh = p.out + b * p.out_batch_stride + h * p.out_head_stride;
      for (int d = 0; d < rank; ++d)
        oh[d] = FloatToBf16(acc[static_cast<size_t>(h) * rank + d] * inv);
      if (p.lse != nullptr) p.lse[b * p.num_heads + h] = SoftmaxLse(state[h]);
    }
  }
}

}  // namespace kvcm::gpu
