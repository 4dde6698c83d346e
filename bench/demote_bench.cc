// Demotion on the agent (gpu/agent/control/command_executor.h): a DemoteBlocks command copies
// blocks of the main pool into newly allocated host-pool blocks. Bytes demoted per second, next to
// a memcpy of the same bytes between the same two arenas in the same run, for DeepSeek-V3
// (MLA, 4.3 MiB per 64-token page), DeepSeek-V2-Lite and Llama-3-70B (GQA, 20 MiB per page).
//   kvcm_demote_bench [--smoke] [google-benchmark flags]
// --smoke (or KVCM_BENCH_SMOKE in the environment) runs small pools briefly (ctest).
// The main pool is on the GPU when one is present (a device-to-host copy per block), in
// host DRAM otherwise; the memcpy baseline runs only when both pools are host memory.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/smoke_flag.h"
#include "benchmark/benchmark.h"
#include "common/model_catalog.h"
#include "common/program_flags.h"
#include "gpu/agent/control/command_executor.h"
#include "gpu/agent/pool/block_pool.h"

namespace kvcm::bench {
namespace {

constexpr uint64_t kEpoch = 1;

struct Pools {
  std::unique_ptr<BlockPool> main;
  std::unique_ptr<BlockPool> host;
  std::vector<BlockId> sources;
};

// A main pool (device when present) and a host pool of `blocks` blocks each, every main
// block allocated to kEpoch and filled.
Pools MakePools(const ModelSpec& spec, uint32_t blocks) {
  Pools p;
  const PoolGeometry g{spec, blocks};
  absl::StatusOr<BackendChoice> main = CreateBackend({.arena_bytes = g.pool_bytes()});
  absl::StatusOr<std::unique_ptr<DeviceBackend>> host = CreateHostBackend(g.pool_bytes());
  if (!main.ok() || !host.ok()) {
    std::fprintf(stderr, "backend: %s %s\n", main.status().ToString().c_str(),
                 host.status().ToString().c_str());
    std::exit(1);
  }
  p.main = *BlockPool::Create(g, std::move(main->backend));
  p.host = *BlockPool::Create(g, *std::move(host));
  // Committed, as the manager's demotions are: the host copies are committed too, so the
  // FreeBlocks that returns them (FreeCommitted) accepts them.
  const NamespaceId ns{"bench", "demote"};
  p.sources = *p.main->Allocate(blocks, kEpoch, &ns);
  std::vector<std::byte> fill(g.bytes_per_block());
  for (size_t i = 0; i < fill.size(); ++i) fill[i] = static_cast<std::byte>(i * 37);
  for (BlockId id : p.sources) (void)p.main->WriteBlocks({&id, 1}, kEpoch, fill);
  std::vector<CommitEntry> pages;
  for (uint64_t i = 0; i < p.sources.size(); ++i) {
    pages.push_back({p.sources[i], PageHash{i + 1, 0}, PageHash{i, 0}});
  }
  (void)p.main->Commit(ns, kEpoch, pages, "block_ids");
  return p;
}

// One DemoteBlocks of `per_command` blocks per iteration (the host blocks are freed again,
// untimed, so every iteration allocates and copies the same amount).
void BM_Demote(benchmark::State& state, ModelSpec spec, uint32_t per_command) {
  Pools p = MakePools(spec, per_command);
  CommandExecutor executor(p.main.get(), Tier::kGpu, p.host.get());
  executor.Reset(kEpoch);
  uint64_t sequence = 0;
  for (auto _ : state) {
    v1::AgentCommand demote;
    demote.set_sequence(++sequence);
    demote.mutable_demote()->mutable_source_block_ids()->Add(p.sources.begin(), p.sources.end());
    const v1::AgentCommandAck ack = executor.Execute(demote);
    state.PauseTiming();
    if (ack.code() != 0) {
      state.SkipWithError(ack.message().c_str());
      break;
    }
    v1::AgentCommand free;
    free.set_sequence(++sequence);
    free.set_acked_through(sequence);
    free.mutable_free()->set_tier(v1::TIER_HOST);
    *free.mutable_free()->mutable_block_ids() = ack.block_ids();
    (void)executor.Execute(free);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(state.iterations() * per_command * p.main->geometry().bytes_per_block());
  state.SetLabel(p.main->backend().name() + " -> host");
}

// The same bytes, memcpy'd block by block from the main arena into the host arena.
void BM_Memcpy(benchmark::State& state, ModelSpec spec, uint32_t per_command) {
  Pools p = MakePools(spec, per_command);
  if (p.main->backend().is_device()) {
    state.SkipWithError("main pool is device memory: no memcpy baseline");
    return;
  }
  const uint64_t bpb = p.main->geometry().bytes_per_block();
  for (auto _ : state) {
    for (uint32_t i = 0; i < per_command; ++i) {
      std::memcpy(p.host->backend().base() + i * bpb,
                  p.main->backend().base() + p.main->BlockOffset(p.sources[i]), bpb);
    }
    benchmark::DoNotOptimize(p.host->backend().base());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * per_command * bpb);
}

int Main(int argc, char** argv) {
  HandleHelpAndVersion(argc, argv, "kvcm_demote_bench", "");
  std::vector<char*> args;
  const bool smoke = bench::TakeSmokeFlag(argc, argv, &args);
  static char min_time[] = "--benchmark_min_time=0.01";
  if (smoke) args.push_back(min_time);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;

  struct Case {
    const char* model;
    uint32_t page_size_tokens;
    uint32_t blocks_per_command;
  };
  const std::vector<Case> cases = smoke ? std::vector<Case>{{"deepseek-v2-lite", 16, 2}}
                                        : std::vector<Case>{{"deepseek-v3", 64, 1},
                                                            {"deepseek-v3", 64, 16},
                                                            {"deepseek-v2-lite", 64, 16},
                                                            {"llama-3-70b", 64, 4}};
  for (const Case& c : cases) {
    absl::StatusOr<ModelSpec> spec = FindModel(c.model);
    if (!spec.ok()) {
      std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
      return 1;
    }
    spec->page_size_tokens = c.page_size_tokens;
    const std::string name =
        absl::StrFormat("%s/page%d/x%d", c.model, c.page_size_tokens, c.blocks_per_command);
    benchmark::RegisterBenchmark(("Demote/" + name).c_str(), BM_Demote, *spec, c.blocks_per_command)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("Memcpy/" + name).c_str(), BM_Memcpy, *spec, c.blocks_per_command)
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) { return kvcm::bench::Main(argc, argv); }
