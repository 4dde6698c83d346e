// The agent's local data path (gpu/agent/local/local_session.h): bytes per second of LOAD (pool ->
// engine region) and STORE (region -> pool) through the real code path — an in-process host
// pool, LocalSocketServer on a Unix socket, LocalClient with a memfd region — next to plain
// memcpy of the same segments between the same two buffers, in the same run. Batches of 64
// blocks, spread over a pool and a region of equal size, each batch's blocks and engine blocks
// drawn at random (cold-ish caches once the buffers exceed the LLC). Full runs take the best
// of 3 interleaved rounds of each measurement.
//   kvcm_local_copy_bench [--smoke]
// Blocks: 32 KiB (2 layers x 16 KiB, a small model's page) and 576 KiB (36 layers x 16 KiB),
// laid out as a vLLM CPU engine's KV: per layer a [num_blocks, 16 KiB] tensor.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/or_die.h"
#include "bench/smoke_flag.h"
#include "common/authenticator.h"
#include "common/model_spec.h"
#include "common/program_flags.h"
#include "gpu/agent/local/local_client.h"
#include "gpu/agent/local/local_socket_server.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/agent/server/agent_metrics.h"

namespace kvcm::bench {
namespace {

constexpr uint64_t kOwner = 1;
constexpr uint32_t kBatch = 64;
constexpr uint64_t kSegmentBytes = 16 << 10;

// GQA bf16, 16-token pages of 4 KV heads x 64 dims: 16 KiB per layer and page.
ModelSpec Spec(uint32_t layers) {
  ModelSpec s;
  s.attention = AttentionKind::kGqa;
  s.num_layers = layers;
  s.num_heads = 8;
  s.num_kv_heads = 4;
  s.head_dim = 64;
  s.dtype = KvDtype::kBf16;
  s.page_size_tokens = 16;
  return s;
}

struct Batch {
  std::vector<BlockId> ids;
  std::vector<uint64_t> gens;
  std::vector<uint32_t> engine;
};

struct Result {
  double memcpy_load = 0, memcpy_store = 0, local_load = 0, local_store = 0;  // bytes/s
};

Result Run(uint32_t layers, uint32_t blocks, int batches, int rounds) {
  const PoolGeometry g{Spec(layers), blocks};
  CheckOk(g.Validate(), "geometry");
  const uint64_t bpb = g.bytes_per_block();
  if (bpb != layers * kSegmentBytes) {
    std::fprintf(stderr, "block of %llu bytes, expected %llu\n", (unsigned long long)bpb,
                 (unsigned long long)(layers * kSegmentBytes));
    std::exit(1);
  }
  std::unique_ptr<BlockPool> pool =
      OrDie(BlockPool::Create(g, OrDie(CreateHostBackend(g.pool_bytes()), "backend")), "pool");
  const NamespaceId ns{"bench", "local"};
  std::vector<uint64_t> gens;
  const std::vector<BlockId> ids = OrDie(pool->Allocate(blocks, kOwner, &ns, &gens), "allocate");
  std::vector<uint64_t> gen_of(blocks);
  for (size_t i = 0; i < ids.size(); ++i) gen_of[ids[i]] = gens[i];
  std::memset(pool->backend().base(), 0x5A, g.pool_bytes());

  // The engine's region: per layer a [blocks, 16 KiB] tensor.
  const uint64_t region_bytes = uint64_t{blocks} * bpb;
  std::unique_ptr<MemfdRegion> region = OrDie(MemfdRegion::Create(region_bytes), "memfd");
  std::memset(region->data(), 0xA5, region_bytes);
  std::vector<uint64_t> offsets(layers);
  for (uint32_t l = 0; l < layers; ++l) offsets[l] = uint64_t{l} * blocks * kSegmentBytes;

  std::mt19937 rng(1);
  std::vector<Batch> plan(batches);
  std::vector<uint32_t> order(blocks);
  for (Batch& b : plan) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (uint32_t i = 0; i < kBatch; ++i) {
      b.ids.push_back(order[i]);
      b.gens.push_back(gen_of[order[i]]);
    }
    std::shuffle(order.begin(), order.end(), rng);
    b.engine.assign(order.begin(), order.begin() + kBatch);
  }
  const double batch_bytes = static_cast<double>(kBatch) * bpb;
  auto timed = [&](auto&& fn) {
    fn(plan[0]);  // warm-up
    const auto start = std::chrono::steady_clock::now();
    for (const Batch& b : plan) fn(b);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return batch_bytes * batches / s;
  };

  std::byte* const arena = pool->backend().base();
  std::byte* const mine = region->data();
  auto memcpy_load = [&](const Batch& b) {
    for (uint32_t i = 0; i < kBatch; ++i) {
      for (uint32_t l = 0; l < layers; ++l) {
        std::memcpy(mine + offsets[l] + b.engine[i] * kSegmentBytes,
                    arena + pool->BlockOffset(b.ids[i]) + l * kSegmentBytes, kSegmentBytes);
      }
    }
  };
  auto memcpy_store = [&](const Batch& b) {
    for (uint32_t i = 0; i < kBatch; ++i) {
      for (uint32_t l = 0; l < layers; ++l) {
        std::memcpy(arena + pool->BlockOffset(b.ids[i]) + l * kSegmentBytes,
                    mine + offsets[l] + b.engine[i] * kSegmentBytes, kSegmentBytes);
      }
    }
  };

  // The real path: server, session, socket, client.
  const std::string path = absl::StrCat("/tmp/kvcm_local_bench_", getpid(), ".sock");
  AgentOptions options;
  options.max_blocks_per_call = kBatch;
  AgentEpoch epoch;
  AgentMetrics metrics("bench", AgentPools{.main = pool.get()}, &epoch);
  std::unique_ptr<Authenticator> open = Authenticator::Open();
  std::unique_ptr<LocalSocketServer> server =
      OrDie(LocalSocketServer::Start({.path = path},
                                     LocalSessionEnv{.options = &options,
                                                     .pools = AgentPools{.main = pool.get()},
                                                     .epoch = &epoch,
                                                     .authenticator = open.get(),
                                                     .metrics = &metrics}),
            "server");
  std::unique_ptr<LocalClient> client = OrDie(LocalClient::Connect(path), "connect");
  v1::LocalRequest hello;
  v1::LocalHello* h = hello.mutable_hello();
  h->set_region_bytes(region_bytes);
  h->mutable_segment_offsets()->Add(offsets.begin(), offsets.end());
  h->set_segment_bytes(kSegmentBytes);
  h->set_segment_stride(kSegmentBytes);
  h->set_num_engine_blocks(blocks);
  const int fd = region->fd();
  CheckOk(LocalReplyStatus(OrDie(client->Call(hello, {&fd, 1}), "hello")), "hello");
  auto copy = [&](v1::LocalDirection dir) {
    return [&, dir](const Batch& b) {
      v1::LocalRequest req;
      v1::LocalCopy* c = req.mutable_copy();
      c->set_direction(dir);
      c->set_owner_epoch(kOwner);
      c->mutable_block_ids()->Add(b.ids.begin(), b.ids.end());
      c->mutable_engine_blocks()->Add(b.engine.begin(), b.engine.end());
      c->mutable_block_generations()->Add(b.gens.begin(), b.gens.end());
      CheckOk(LocalReplyStatus(OrDie(client->Call(req), "copy")), "copy");
    };
  };
  // Interleaved rounds, the best of each: other load on the machine only slows a round down.
  Result r;
  for (int round = 0; round < rounds; ++round) {
    r.memcpy_load = std::max(r.memcpy_load, timed(memcpy_load));
    r.local_load = std::max(r.local_load, timed(copy(v1::LOCAL_DIRECTION_LOAD)));
    r.memcpy_store = std::max(r.memcpy_store, timed(memcpy_store));
    r.local_store = std::max(r.local_store, timed(copy(v1::LOCAL_DIRECTION_STORE)));
  }
  client.reset();
  server.reset();
  return r;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) {
  kvcm::HandleHelpAndVersion(
      argc, argv, "kvcm_local_copy_bench",
      "kvcm_local_copy_bench [--smoke]: the agent's local one-copy path against memcpy");
  const bool smoke = kvcm::bench::SmokeFlagOnly(argc, argv, "kvcm_local_copy_bench [--smoke]");
  struct Config {
    const char* name;
    uint32_t layers;
    uint32_t blocks;  // in the pool and in the region
    int batches;
  };
  // Full: pool and region of 128 MiB / 288 MiB each (well past the LLC).
  const Config full[] = {{"32 KiB (2 x 16 KiB)", 2, 4096, 500},
                         {"576 KiB (36 x 16 KiB)", 36, 512, 40}};
  const Config tiny[] = {{"32 KiB (2 x 16 KiB)", 2, 256, 40}, {"576 KiB (36 x 16 KiB)", 36, 64, 8}};
  std::printf("kvcm_local_copy_bench%s: batches of %u blocks, GB/s (1e9 bytes/s)\n",
              smoke ? " --smoke" : "", kvcm::bench::kBatch);
  std::printf("%-24s %10s %10s %10s %10s %11s %11s\n", "block", "memcpy-ld", "LOAD", "memcpy-st",
              "STORE", "LOAD/mcpy", "STORE/mcpy");
  for (const Config& c : smoke ? std::span<const Config>(tiny) : std::span<const Config>(full)) {
    const kvcm::bench::Result r = kvcm::bench::Run(c.layers, c.blocks, c.batches, smoke ? 1 : 3);
    std::printf("%-24s %10.2f %10.2f %10.2f %10.2f %11.2f %11.2f\n", c.name, r.memcpy_load / 1e9,
                r.local_load / 1e9, r.memcpy_store / 1e9, r.local_store / 1e9,
                r.local_load / r.memcpy_load, r.local_store / r.memcpy_store);
  }
  return 0;
}
