// What the sources of kvcm_core_bench share: the namespace every benchmark's index uses,
// per-call timing and latency counters, the summary printed after the run, and the replay
// benchmarks (core_bench_replay.cc) that core_bench.cc registers. Not thread-safe: the
// benchmarks run one at a time.
#ifndef KVCM_BENCH_CORE_BENCH_H_
#define KVCM_BENCH_CORE_BENCH_H_

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "bench/workload.h"
#include "server/core/cache_index.h"

namespace kvcm::bench {

using SteadyClock = std::chrono::steady_clock;

// The namespace of every index this binary builds.
inline const NamespaceId kNamespace{"bench", "deepseek-v3"};

// A CacheIndex with `spec` registered under kNamespace (aborts if that fails), keyed by the
// binary's one secret, and pools that never evict unless sized with SetPoolCapacity.
std::unique_ptr<CacheIndex> NewIndex(absl::Duration regret_window, const ModelSpec& spec);
// kNamespace's key under that secret: what a workload hashes its pages with.
HashKey NamespaceKey();

double Seconds(SteadyClock::duration d);

// Sets p50/p99/p999/max counters (ns) from `h` with `prefix`, and returns "p50 .. p99 .."
// for the summary.
std::string PublishLatency(benchmark::State& state, LatencyHistogram& h,
                           absl::string_view prefix = "");

// One line of the summary printed after the benchmarks: what docs/PERFORMANCE.md quotes.
struct SummaryRow {
  std::string name;
  std::string figures;
};
std::vector<SummaryRow>& Summary();

// A request of a replay: the prompt and the agent that serves it.
struct ReplayRequest {
  std::span<const PageHash> pages;
  uint32_t agent;
};

// Replay/chat: the turns of `workload`'s conversations, `window` conversations at a time,
// each request Match(pin) + Insert + Release, on pools of `capacity_fraction` of the
// distinct pages each would hold without eviction.
void BM_ReplayChat(benchmark::State& state, const std::string& name,
                   const ChatWorkloadOptions& workload, uint32_t window, double capacity_fraction);
// Replay/mooncake: `requests` (a trace's whole-page prompts, in order) on one agent whose
// pool holds 10% of them.
void BM_ReplayMooncake(benchmark::State& state, const std::string& name,
                       const std::vector<ReplayRequest>& requests);
// IndexBuild/mooncake: heap per page-location of the index `requests` build with no
// eviction, then DropPool and the sweep of that pool (summary row DropPool/mooncake).
void BM_IndexBuildMooncake(benchmark::State& state, const std::string& name,
                           const std::vector<ReplayRequest>& requests);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_CORE_BENCH_H_
