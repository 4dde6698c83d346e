// Pools for the agent's tests. A small GQA pool on the host backend (block_pool_test.cc,
// command_executor_test.cc). MLA pools with known contents for the RunMlaDecodeOnPool
// tests, host (block_pool_test.cc) and CUDA (pool_attention_cuda_test.cc): the same bytes
// can be written to a pool on any backend, and the attended layer can be taken out alone
// for an independent reference.
#ifndef KVCM_TESTS_UTIL_AGENT_POOLS_H_
#define KVCM_TESTS_UTIL_AGENT_POOLS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/agent/pool/pool_attention.h"
#include "gpu/agent/pool/pool_geometry.h"

namespace kvcm {

// A small GQA spec: 2 layers x 4 kv heads (of 8) x 8 dims, pages of 4 tokens, bf16: 1 KiB
// blocks.
ModelSpec SmallGqa();

// A pool of `blocks` blocks of `spec` on a fresh host backend. An invalid geometry or a
// failed step is a test failure (EXPECT); with no pool to return, the binary then aborts.
std::unique_ptr<BlockPool> MakeHostPool(const ModelSpec& spec, uint64_t blocks);

// Blocks in the pools ScatteredMlaRequest addresses.
inline constexpr uint64_t kMlaTestPoolBlocks = 8;

// `count` bf16 values drawn from N(0, 1).
std::vector<uint16_t> RandomBf16(size_t count, uint32_t seed);

// Bytes of every block of an MLA pool of geometry `g` (bf16 or fp8), in block-id order
// (g.pool_bytes() long): layer `layer` of every block holds random latents (for fp8,
// QuantizeLatentsFp8Cpu of them); every other byte is 0xFF, a NaN in bf16, e4m3 and the
// fp8 scales, so a kernel reading another layer produces NaN.
std::vector<std::byte> MakeMlaPoolBytes(const PoolGeometry& g, uint32_t layer, uint32_t seed);

// Layer `layer` of `pool_bytes` alone: [num_blocks, page_size, token bytes], the compact
// paged cache (block stride page_size x token bytes) a kernel could read directly.
std::vector<std::byte> ExtractLayer(const PoolGeometry& g, uint32_t layer,
                                    std::span<const std::byte> pool_bytes);

// A pool of geometry `g` on `backend` whose every block is allocated to `epoch` and holds
// its share of `pool_bytes` (as MakeMlaPoolBytes returns).
absl::StatusOr<std::unique_ptr<BlockPool>> MakeFilledPool(const PoolGeometry& g,
                                                          std::unique_ptr<DeviceBackend> backend,
                                                          uint64_t epoch,
                                                          std::span<const std::byte> pool_bytes);

// Three sequences of 16 heads over layer `layer` of a kMlaTestPoolBlocks pool of 64-token
// pages, blocks scattered and out of order: 2 pages + 37 tokens (ends mid-block), 70 tokens
// and 1 token; block 2 is in the first and the last. `query` ([3, 16, 576] bf16) must
// outlive the request.
PoolAttentionRequest ScatteredMlaRequest(uint32_t layer, uint64_t epoch,
                                         std::span<const uint16_t> query);
inline constexpr size_t kScatteredBatch = 3;
inline constexpr uint32_t kScatteredHeads = 16;

}  // namespace kvcm

#endif  // KVCM_TESTS_UTIL_AGENT_POOLS_H_
