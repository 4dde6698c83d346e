// What --verify_block_digests costs the agent (issue 35): a commit digests each new block, and
// every read of a committed block checks the digest first. On one in-process host pool, in one
// run, the same work with digests off and on: write every block (WriteBlocks), commit them,
// then read each committed block whole (ReadRange with the page check, as ReadBlocks does).
// Prints ms per block of each phase, off and on, and their ratio.
//   kvcm_block_digest_bench [--smoke]
// Full: deepseek-v3's blocks (bf16, 64-token pages: 4.3 MiB), 64 blocks, 5 rounds; smoke: a
// small GQA block, 2 rounds, to keep the code path alive.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "bench/or_die.h"
#include "bench/smoke_flag.h"
#include "common/model_catalog.h"
#include "common/program_flags.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/device_backend.h"

namespace kvcm::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kOwner = 1;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Phases {
  double write_ms = 0, commit_ms = 0, read_ms = 0;  // per block, best round
};

Phases RunOnce(const ModelSpec& spec, uint32_t blocks, int rounds, bool digests) {
  const PoolGeometry g{spec, blocks};
  std::unique_ptr<BlockPool> pool =
      OrDie(BlockPool::Create(g, OrDie(CreateHostBackend(g.pool_bytes()), "backend")), "pool");
  if (digests) pool->EnableDigests(0x6b76636d, 0x64696765);
  const uint64_t bpb = g.bytes_per_block();
  std::vector<std::byte> bytes(bpb * blocks);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 131 + 7);
  std::vector<std::byte> out(bpb);
  const NamespaceId ns{"bench", "digest"};
  Phases best{1e30, 1e30, 1e30};
  for (int r = 0; r < rounds; ++r) {
    const std::vector<BlockId> ids = OrDie(pool->Allocate(blocks, kOwner, &ns), "allocate");
    std::vector<CommitEntry> entries(blocks);
    std::vector<PageHash> pages(blocks);
    for (uint32_t i = 0; i < blocks; ++i) {
      pages[i] = PageHash{.lo = static_cast<uint64_t>(r) * blocks + i + 1, .hi = 1};
      entries[i] = {.block = ids[i], .page = pages[i], .parent = i ? pages[i - 1] : PageHash{}};
    }
    const Clock::time_point t0 = Clock::now();
    CheckOk(pool->WriteBlocks(ids, kOwner, bytes), "write");
    const Clock::time_point t1 = Clock::now();
    OrDie(pool->Commit(ns, kOwner, entries, "block_ids", 0, {.block_bytes = bpb}), "commit");
    const Clock::time_point t2 = Clock::now();
    for (uint32_t i = 0; i < blocks; ++i) {
      const PageCheck check{.ns = &ns, .pages = {&pages[i], 1}};
      CheckOk(pool->ReadRange({&ids[i], 1}, {}, kOwner, 0, out, "block_ids", &check), "read");
    }
    const Clock::time_point t3 = Clock::now();
    best.write_ms = std::min(best.write_ms, Ms(t1 - t0) / blocks);
    best.commit_ms = std::min(best.commit_ms, Ms(t2 - t1) / blocks);
    best.read_ms = std::min(best.read_ms, Ms(t3 - t2) / blocks);
    CheckOk(pool->FreeCommitted(ids, kOwner, "block_ids"), "free");
  }
  return best;
}

void Run(const ModelSpec& spec, uint32_t blocks, int rounds) {
  const Phases off = RunOnce(spec, blocks, rounds, false);
  const Phases on = RunOnce(spec, blocks, rounds, true);
  const double mib = static_cast<double>(PoolGeometry{spec, 1}.bytes_per_block()) / (1 << 20);
  std::printf("%u blocks of %.2f MiB, best of %d rounds; ms per block\n", blocks, mib, rounds);
  std::printf("%-8s %10s %10s %7s\n", "phase", "off", "on", "on/off");
  std::printf("%-8s %10.3f %10.3f %7.2f\n", "write", off.write_ms, on.write_ms,
              on.write_ms / off.write_ms);
  std::printf("%-8s %10.3f %10.3f %7.2f\n", "commit", off.commit_ms, on.commit_ms,
              on.commit_ms / std::max(off.commit_ms, 1e-9));
  std::printf("%-8s %10.3f %10.3f %7.2f\n", "read", off.read_ms, on.read_ms,
              on.read_ms / off.read_ms);
  std::printf("digest throughput: %.2f GB/s (commit), %.2f GB/s (read, less the copy)\n",
              mib * (1 << 20) / 1e6 / std::max(on.commit_ms - off.commit_ms, 1e-9),
              mib * (1 << 20) / 1e6 / std::max(on.read_ms - off.read_ms, 1e-9));
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) {
  kvcm::HandleHelpAndVersion(argc, argv, "kvcm_block_digest_bench",
                             "kvcm_block_digest_bench [--smoke]: what block digests cost");
  const bool smoke = kvcm::bench::SmokeFlagOnly(argc, argv, "kvcm_block_digest_bench [--smoke]");
  const kvcm::ModelSpec spec = kvcm::bench::DeepSeekV3OrSmokeSpec(smoke);
  std::printf("kvcm_block_digest_bench%s\n", smoke ? " --smoke" : "");
  kvcm::bench::Run(spec, smoke ? 4 : 64, smoke ? 2 : 5);
  return 0;
}
