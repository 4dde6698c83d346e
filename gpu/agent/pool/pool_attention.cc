#include "gpu/agent/pool/pool_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_math.h"

#ifdef KVCM_CUDA_ENABLED
#include "gpu/agent/pool/pool_attention_cuda.h"
#endif

namespace kvcm {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

// A validated request as the kernels take it, host and device alike. `params` points into
// the vectors (host memory) and has every field set but kv_cache, which is the arena at
// `layer_offset` and known only under the pool's lock. Not copyable (params points inside).
struct PoolDecode {
  PoolDecode() = default;
  PoolDecode(const PoolDecode&) = delete;
  PoolDecode& operator=(const PoolDecode&) = delete;

  std::vector<int32_t> block_table;  // [batch, max_blocks]
  std::vector<int32_t> seq_lens;     // [batch]
  std::vector<uint16_t> q;           // [batch, num_heads, kv_lora_rank + rope_dim] bf16
  std::vector<uint16_t> out;         // [batch, num_heads, kv_lora_rank] bf16
  std::vector<float> lse;            // [batch, num_heads]
  std::vector<BlockId> distinct;     // every listed block once, for the ownership check
  uint64_t layer_offset = 0;         // bytes from the arena's start to layer `layer` of block 0
  gpu::MlaDecodeParams params;
};

// Every check RunMlaDecodeOnPool makes before touching the pool, then the kernel's inputs.
absl::Status PrepareDecode(const BlockPool& pool, const PoolAttentionRequest& req, PoolDecode* d) {
  const PoolGeometry& g = pool.geometry();
  const ModelSpec& spec = g.spec;
  if (spec.attention != AttentionKind::kMla ||
      (spec.dtype != KvDtype::kBf16 && spec.dtype != KvDtype::kFp8)) {
    return Invalid("pool",
                   absl::StrCat("must hold MLA bf16 or fp8 latents, not ", spec.DebugString()));
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
  std::vector<BlockId>& distinct = d->distinct;
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
  d->block_table.resize(batch * max_blocks);
  d->seq_lens.resize(batch);
  for (size_t b = 0; b < batch; ++b) {
    const std::vector<BlockId>& row = req.block_table[b];
    for (size_t i = 0; i < max_blocks; ++i) {
      d->block_table[b * max_blocks + i] = static_cast<int32_t>(i < row.size() ? row[i] : row[0]);
    }
    d->seq_lens[b] = static_cast<int32_t>(req.seq_lens[b]);
  }
  d->q.resize(query_bytes / 2);
  std::memcpy(d->q.data(), req.query_bf16.data(), query_bytes);
  d->out.resize(batch * req.num_heads * spec.kv_lora_rank);
  d->lse.resize(batch * req.num_heads);
  // Layer `layer` of block b starts at b * bytes_per_block + layer_offset (pool_geometry.h).
  d->layer_offset = uint64_t{req.layer} * spec.BytesPerTokenPerLayer() * page;

  gpu::MlaDecodeParams& p = d->params;
  p.kv_block_stride_bytes = static_cast<int64_t>(g.bytes_per_block());
  p.block_table = d->block_table.data();
  p.block_table_stride = static_cast<int64_t>(max_blocks);
  p.seq_lens = d->seq_lens.data();
  p.q = d->q.data();
  p.q_head_stride = static_cast<int64_t>(head_dim);
  p.q_batch_stride = static_cast<int64_t>(req.num_heads * head_dim);
  p.out = d->out.data();
  p.out_head_stride = spec.kv_lora_rank;
  p.out_batch_stride = static_cast<int64_t>(req.num_heads) * spec.kv_lora_rank;
  p.lse = d->lse.data();
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
  return absl::OkStatus();
}

// `p` with p.kv_cache in the device arena of `backend`: the CUDA kernel where this build
// has it.
absl::Status DecodeOnDevice(const DeviceBackend& backend, const gpu::MlaDecodeParams& p) {
#ifdef KVCM_CUDA_ENABLED
  return MlaDecodeOverDeviceCache(p);
#else
  return absl::UnimplementedError(
      absl::StrCat("the pool is on device backend ", backend.name(),
                   " but this build has no CUDA (KVCM_CUDA_ENABLED unset), so no kernel can "
                   "read it"));
#endif
}

// The generation of each block of `distinct` (sorted, as PrepareDecode leaves it), from
// req.block_generations: INVALID_ARGUMENT "block_generations" for a shape unlike
// block_table's or a block listed with two generations.
absl::StatusOr<std::vector<uint64_t>> DistinctGenerations(const PoolAttentionRequest& req,
                                                          const std::vector<BlockId>& distinct) {
  if (req.block_generations.size() != req.block_table.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_generations: ", req.block_generations.size(), " rows for ",
                     req.block_table.size(), " rows of block_table"));
  }
  std::vector<uint64_t> out(distinct.size(), 0);
  for (size_t b = 0; b < req.block_table.size(); ++b) {
    const std::vector<BlockId>& row = req.block_table[b];
    if (req.block_generations[b].size() != row.size()) {
      return absl::InvalidArgumentError(absl::StrCat("block_generations[", b,
                                                     "]: ", req.block_generations[b].size(),
                                                     " generations for ", row.size(), " blocks"));
    }
    for (size_t i = 0; i < row.size(); ++i) {
      const size_t k =
          std::lower_bound(distinct.begin(), distinct.end(), row[i]) - distinct.begin();
      const uint64_t g = req.block_generations[b][i];
      if (out[k] != 0 && out[k] != g) {
        return absl::InvalidArgumentError(
            absl::StrCat("block_generations[", b, "][", i, "]: block ", row[i],
                         " listed with generations ", out[k], " and ", g));
      }
      out[k] = g;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<PoolAttentionResult> RunMlaDecodeOnPool(const BlockPool& pool,
                                                       const PoolAttentionRequest& req) {
  PoolDecode d;
  if (absl::Status s = PrepareDecode(pool, req, &d); !s.ok()) return s;
  std::vector<uint64_t> generations;  // parallel to d.distinct
  if (!req.block_generations.empty()) {
    absl::StatusOr<std::vector<uint64_t>> g = DistinctGenerations(req, d.distinct);
    if (!g.ok()) return g.status();
    generations = *std::move(g);
  }
  const DeviceBackend& backend = pool.backend();
  absl::Status run = pool.WithOwnedArena(
      d.distinct, req.owner_epoch, "block_table",
      [&](const std::byte* arena) {
        d.params.kv_cache = arena + d.layer_offset;
        return backend.is_device() ? DecodeOnDevice(backend, d.params)
                                   : gpu::MlaDecodeCpu(d.params);
      },
      generations);
  if (!run.ok()) return run;
  PoolAttentionResult result;
  result.output.resize(d.out.size());
  for (size_t i = 0; i < d.out.size(); ++i) result.output[i] = gpu::Bf16ToFloat(d.out[i]);
  result.lse = std::move(d.lse);
  return result;
}

}  // namespace kvcm
