// The agent side the BlockAgent and data-port harnesses run against: a host-backed main
// pool (a small MLA model, so RunAttention reaches the CPU kernel) and a host pool, the
// options that bound requests, and the agent's epoch, with blocks in each state: free,
// allocated to the epoch and written, and committed to pages of a namespace. Fresh per
// input; the seed generator builds its valid requests from the same constants.
#ifndef KVCM_FUZZ_AGENT_WORLD_H_
#define KVCM_FUZZ_AGENT_WORLD_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "fuzz/fuzz_input.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/agent/pool/pool_geometry.h"

namespace kvcm::fuzz {

// A two-layer MLA model with a 64 + 16 latent and 4-token pages (640 bytes a page).
inline ModelSpec AgentSpec() {
  ModelSpec s;
  s.attention = AttentionKind::kMla;
  s.num_layers = 2;
  s.num_heads = 4;
  s.kv_lora_rank = 64;
  s.rope_dim = 16;
  s.dtype = KvDtype::kBf16;
  s.page_size_tokens = 4;
  return s;
}
inline const NamespaceId& AgentNamespace() {
  static const NamespaceId* ns = new NamespaceId{"tenant-a", "model-mla"};
  return *ns;
}
inline constexpr uint64_t kMainBlocks = 16;
inline constexpr uint64_t kHostBlocks = 8;
// Blocks 0..3 of the main pool are committed to CommittedPage(0..3), blocks 4..7 allocated
// to the epoch and written; the rest are free.
inline constexpr int kCommittedBlocks = 4;
inline constexpr int kOwnedBlocks = 4;
// The owner epoch of the seeded blocks (a constant: inputs name it).
inline constexpr uint64_t kOwnerEpoch = 1;
inline PageHash CommittedPage(int i) { return PageHash{0x1000u + i, 0x2000u + i}; }

inline std::unique_ptr<BlockPool> MakePool(uint64_t blocks) {
  const PoolGeometry g{AgentSpec(), blocks};
  absl::StatusOr<std::unique_ptr<DeviceBackend>> backend = CreateHostBackend(g.pool_bytes());
  Require(backend.ok(), "host backend");
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::Create(g, *std::move(backend));
  Require(pool.ok(), "pool");
  return *std::move(pool);
}

struct AgentWorld {
  AgentOptions options{.tls = {.insecure = true}};
  std::unique_ptr<BlockPool> main = MakePool(kMainBlocks);
  std::unique_ptr<BlockPool> host = MakePool(kHostBlocks);
  AgentPools pools{main.get(), host.get()};
  AgentEpoch epoch;  // what Fetch allocates under (clock-based, so not the seeded blocks')
  uint64_t owner_epoch = kOwnerEpoch;
  std::vector<BlockId> committed;  // committed[i] holds CommittedPage(i)
  std::vector<BlockId> owned;      // allocated to owner_epoch, written

  AgentWorld() {
    // Small enough that a ReadBlocks streams several chunks and a WriteBlocks takes several.
    options.read_chunk_bytes = 1000;
    options.max_message_bytes = 1024;
    options.max_blocks_per_call = 8;
    Require(options.Validate().ok(), "options");
    epoch.Advance();
    const uint64_t bpb = main->geometry().bytes_per_block();
    absl::StatusOr<std::vector<BlockId>> ids =
        main->Allocate(kCommittedBlocks, owner_epoch, &AgentNamespace());
    Require(ids.ok(), "allocate committed");
    committed = *ids;
    std::vector<std::byte> bytes(kCommittedBlocks * bpb, std::byte{0x3c});
    Require(main->WriteBlocks(committed, owner_epoch, bytes).ok(), "write committed");
    std::vector<CommitEntry> entries;
    for (int i = 0; i < kCommittedBlocks; ++i) {
      entries.push_back({.block = committed[i],
                         .page = CommittedPage(i),
                         .parent = i == 0 ? PageHash{} : CommittedPage(i - 1)});
    }
    Require(main->Commit(AgentNamespace(), owner_epoch, entries, "block_ids").ok(), "commit");
    ids = main->Allocate(kOwnedBlocks, owner_epoch, nullptr);
    Require(ids.ok(), "allocate owned");
    owned = *ids;
    bytes.assign(kOwnedBlocks * bpb, std::byte{0x11});
    Require(main->WriteBlocks(owned, owner_epoch, bytes).ok(), "write owned");
  }
};

}  // namespace kvcm::fuzz

#endif  // KVCM_FUZZ_AGENT_WORLD_H_
