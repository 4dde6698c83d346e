#include "tests/util/agent_pools.h"

#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "gpu/kernels/fp8_latent_cpu.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"

namespace kvcm {

ModelSpec SmallGqa() {
  ModelSpec s;
  s.attention = AttentionKind::kGqa;
  s.num_layers = 2;
  s.num_heads = 8;
  s.num_kv_heads = 4;
  s.head_dim = 8;
  s.dtype = KvDtype::kBf16;
  s.page_size_tokens = 4;
  return s;
}

std::unique_ptr<BlockPool> MakeHostPool(const ModelSpec& spec, uint64_t blocks) {
  PoolGeometry g{spec, blocks};
  EXPECT_TRUE(g.Validate().ok()) << g.Validate();
  absl::StatusOr<std::unique_ptr<DeviceBackend>> host = CreateHostBackend(g.pool_bytes());
  EXPECT_TRUE(host.ok()) << host.status();
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::Create(g, *std::move(host));
  EXPECT_TRUE(pool.ok()) << pool.status();
  return *std::move(pool);
}

std::vector<uint16_t> RandomBf16(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> v(count);
  for (uint16_t& x : v) x = gpu::FloatToBf16(normal(rng));
  return v;
}

std::vector<std::byte> MakeMlaPoolBytes(const PoolGeometry& g, uint32_t layer, uint32_t seed) {
  const uint64_t page = g.spec.page_size_tokens;
  const uint64_t token_bytes = g.spec.BytesPerTokenPerLayer();
  const uint64_t layer_bytes = page * token_bytes;
  const uint64_t head_dim = uint64_t{g.spec.kv_lora_rank} + g.spec.rope_dim;
  std::vector<std::byte> bytes(g.pool_bytes(), std::byte{0xFF});
  for (uint64_t b = 0; b < g.num_blocks; ++b) {
    const std::vector<uint16_t> latents =
        RandomBf16(page * head_dim, seed + static_cast<uint32_t>(b));
    std::byte* dst = bytes.data() + b * g.bytes_per_block() + layer * layer_bytes;
    if (g.spec.dtype == KvDtype::kFp8) {
      gpu::QuantizeLatentsFp8Cpu(latents.data(), static_cast<int64_t>(page),
                                 reinterpret_cast<uint8_t*>(dst));
    } else {
      std::memcpy(dst, latents.data(), layer_bytes);
    }
  }
  return bytes;
}

std::vector<std::byte> ExtractLayer(const PoolGeometry& g, uint32_t layer,
                                    std::span<const std::byte> pool_bytes) {
  const uint64_t layer_bytes = g.spec.page_size_tokens * g.spec.BytesPerTokenPerLayer();
  std::vector<std::byte> out(g.num_blocks * layer_bytes);
  for (uint64_t b = 0; b < g.num_blocks; ++b) {
    std::memcpy(out.data() + b * layer_bytes,
                pool_bytes.data() + b * g.bytes_per_block() + layer * layer_bytes, layer_bytes);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<BlockPool>> MakeFilledPool(const PoolGeometry& g,
                                                          std::unique_ptr<DeviceBackend> backend,
                                                          uint64_t epoch,
                                                          std::span<const std::byte> pool_bytes) {
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::Create(g, std::move(backend));
  if (!pool.ok()) return pool.status();
  absl::StatusOr<std::vector<BlockId>> ids =
      (*pool)->Allocate(static_cast<uint32_t>(g.num_blocks), epoch);
  if (!ids.ok()) return ids.status();
  std::vector<BlockId> in_order(g.num_blocks);
  for (uint64_t b = 0; b < g.num_blocks; ++b) in_order[b] = static_cast<BlockId>(b);
  if (absl::Status s = (*pool)->WriteBlocks(in_order, epoch, pool_bytes); !s.ok()) return s;
  return pool;
}

PoolAttentionRequest ScatteredMlaRequest(uint32_t layer, uint64_t epoch,
                                         std::span<const uint16_t> query) {
  PoolAttentionRequest req;
  req.block_table = {{5, 2, 7}, {1, 6}, {2}};
  req.seq_lens = {2 * 64 + 37, 70, 1};
  req.query_bf16 = std::as_bytes(query);
  req.softmax_scale = 1.0f / std::sqrt(192.0f);
  req.num_heads = kScatteredHeads;
  req.layer = layer;
  req.owner_epoch = epoch;
  return req;
}

}  // namespace kvcm
