#include "gpu/agent/pool_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

}  // namespace

absl::StatusOr<PoolAttentionResult> RunMlaDecodeOnPool(const BlockPool& pool,
                                                       const PoolAttentionRequest& req) {
  const PoolGeometry& g = pool.geometry();
  const ModelSpec& spec = g.spec;
  if (spec.attention != AttentionKind::kMla ||
      (spec.dtype != KvDtype::kBf16 && spec.dtype != KvDtype::kFp8)) {
    return Invalid("pool",
                   absl::StrCat("must hold MLA bf16 or fp8 latents, not ", spec.DebugString()));
  }
  if (pool.backend().is_device()) {
    return absl::UnimplementedError(absl::StrCat(
        "RunAttention runs the CPU kernel over a host pool; this pool is on ",
        pool.backend().name(), " and the CUDA launcher (MlaDecodeCuda) is not wired here"));
  }
  const size_t batch = req.block_table.size();
  if (batch < 1 || batch > PoolAttentionRequest::kMaxBatch) {
    return Invalid("block_table", absl::StrCat("must list 1..", PoolAttentionRequest::kMaxBatch,
                                               " sequences, got ", batch));
  }
  if (req.seq_lens.size() != batch) {
    return Invalid("seq_lens", absl::StrCat("must have one entry per sequence (", batch, "), got ",
                                            req.seq_lens.size()));
  }
  if (req.num_heads < 1 || req.num_heads > PoolAttentionRequest::kMaxHeads) {
    return Invalid("num_heads", absl::StrCat("must be in [1, ", PoolAttentionRequest::kMaxHeads,
                                             "], got ", req.num_heads));
  }
  if (req.layer >= spec.num_layers) {
    return Invalid("layer",
                   absl::StrCat("must be < num_layers ", spec.num_layers, ", got ", req.layer));
  }
  if (!std::isfinite(req.softmax_scale) || req.softmax_scale <= 0.0f) {
    return Invalid("softmax_scale",
                   absl::StrCat("must be finite and > 0, got ", req.softmax_scale));
  }
  const uint64_t page = spec.page_size_tokens;
  const uint64_t head_dim = uint64_t{spec.kv_lora_rank} + spec.rope_dim;
  const uint64_t query_bytes = batch * req.num_heads * head_dim * 2;
  if (req.query_bf16.size() != query_bytes) {
    return Invalid("query", absl::StrCat("must be batch x num_heads x ", head_dim, " bf16 = ",
                                         query_bytes, " bytes, got ", req.query_bf16.size()));
  }
  size_t max_blocks = 0;
  std::vector<BlockId> distinct;
  for (size_t b = 0; b < batch; ++b) {
    const std::vector<BlockId>& row = req.block_table[b];
    if (req.seq_lens[b] < 1 || req.seq_lens[b] > row.size() * page) {
      return Invalid(absl::StrCat("seq_lens[", b, "]"),
                     absl::StrCat("must be in [1, ", row.size(), " blocks x ", page, "], got ",
                                  req.seq_lens[b]));
    }
    max_blocks = std::max(max_blocks, row.size());
    distinct.insert(distinct.end(), row.begin(), row.end());
  }
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  if (distinct.back() > static_cast<BlockId>(std::numeric_limits<int32_t>::max())) {
    return Invalid("block_table",
                   absl::StrCat("block ", distinct.back(), " does not fit the kernel's int32 ids"));
  }

  // The kernel's [batch, max_blocks] table; a short row is padded with its own first block
  // (never read: seq_lens bound the walk).
  std::vector<int32_t> table(batch * max_blocks);
  std::vector<int32_t> seq_lens(batch);
  for (size_t b = 0; b < batch; ++b) {
    const std::vector<BlockId>& row = req.block_table[b];
    for (size_t i = 0; i < max_blocks; ++i) {
      table[b * max_blocks + i] = static_cast<int32_t>(i < row.size() ? row[i] : row[0]);
    }
    seq_lens[b] = static_cast<int32_t>(req.seq_lens[b]);
  }
  std::vector<uint16_t> q(query_bytes / 2);
  std::memcpy(q.data(), req.query_bf16.data(), query_bytes);
  std::vector<uint16_t> out(batch * req.num_heads * spec.kv_lora_rank);
  PoolAttentionResult result;
  result.lse.resize(batch * req.num_heads);

  gpu::MlaDecodeParams p;
  p.kv_block_stride_bytes = static_cast<int64_t>(g.bytes_per_block());
  p.block_table = table.data();
  p.block_table_stride = static_cast<int64_t>(max_blocks);
  p.seq_lens = seq_lens.data();
  p.q = q.data();
  p.q_head_stride = static_cast<int64_t>(head_dim);
  p.q_batch_stride = static_cast<int64_t>(req.num_heads * head_dim);
  p.out = out.data();
  p.out_head_stride = spec.kv_lora_rank;
  p.out_batch_stride = static_cast<int64_t>(req.num_heads) * spec.kv_lora_rank;
  p.lse = result.lse.data();
  p.batch = static_cast<int>(batch);
  p.num_heads = static_cast<int>(req.num_heads);
  p.num_blocks =
      static_cast<int>(std::min<uint64_t>(g.num_blocks, std::numeric_limits<int32_t>::max()));
  p.page_size = static_cast<int>(page);
  p.max_blocks_per_seq = static_cast<int>(max_blocks);
  p.kv_lora_rank = static_cast<int>(spec.kv_lora_rank);
  p.rope_dim = static_cast<int>(spec.rope_dim);
  p.dtype = spec.dtype == KvDtype::kFp8 ? gpu::LatentDtype::kFp8E4m3 : gpu::LatentDtype::kBf16;
  p.softmax_scale = req.softmax_scale;
  const uint64_t layer_offset = uint64_t{req.layer} * spec.BytesPerTokenPerLayer() * page;

  absl::Status run = pool.WithOwnedHostArena(distinct, req.owner_epoch, "block_table",
                                             [&](const std::byte* arena) {
                                               p.kv_cache = arena + layer_offset;
                                               return gpu::MlaDecodeCpu(p);
                                             });
  if (!run.ok()) return run;
  result.output.resize(out.size());
  for (size_t i = 0; i < out.size(); ++i) result.output[i] = gpu::Bf16ToFloat(out[i]);
  return result;
}

}  // namespace kvcm
