// kvcm_core_bench's benchmarks over request streams (see core_bench.cc for the list and
// how figures are measured): Replay/chat over ChatWorkload conversations, and with --trace
// Replay/mooncake and IndexBuild/mooncake (with DropPool/mooncake) over a Mooncake trace.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/core_bench.h"
#include "bench/replay/trace.h"
#include "bench/workload.h"
#include "server/core/cache_index.h"

namespace kvcm::bench {
namespace {

// Match(pin) + Insert + Release per request, all timed as one call, on pools whose
// capacity is `capacity_fraction` of the distinct pages each would hold without eviction.
void RunReplay(benchmark::State& state, const std::string& name, const ModelSpec& spec,
               const std::vector<ReplayRequest>& requests, uint32_t agents,
               double capacity_fraction) {
  std::unique_ptr<CacheIndex> index = NewIndex(absl::Minutes(5), spec);
  // Distinct pages per agent, counted by walking the requests once into a set.
  std::vector<absl::flat_hash_set<PageHash>> distinct(agents);
  for (const ReplayRequest& r : requests) distinct[r.agent].insert(r.pages.begin(), r.pages.end());
  std::vector<PoolKey> pools;
  for (uint32_t a = 0; a < agents; ++a) {
    pools.push_back(PoolKey{absl::StrCat("agent-", a), Tier::kGpu});
    const uint64_t pages =
        std::max<uint64_t>(static_cast<uint64_t>(distinct[a].size() * capacity_fraction), 1);
    if (absl::Status s = index->SetPoolCapacity(pools.back(), pages * spec.BytesPerPage());
        !s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
  }
  distinct.clear();
  std::vector<MatchOptions> by_agent(agents);
  for (uint32_t a = 0; a < agents; ++a) {
    by_agent[a].requester_agent_id = pools[a].agent_id;
    by_agent[a].pin = true;
  }
  BlockAllocator blocks;
  LatencyHistogram lat;
  lat.Reserve(state.max_iterations);
  uint64_t page_ops = 0, requested = 0, matched = 0, i = 0;
  for (auto _ : state) {
    const ReplayRequest& req = requests[i++ % requests.size()];
    std::span<const BlockId> ids = blocks.Next(req.agent, req.pages.size());
    const auto start = SteadyClock::now();
    absl::StatusOr<MatchResult> m = index->Match(kNamespace, req.pages, by_agent[req.agent]);
    absl::StatusOr<InsertResult> ins = index->Insert(kNamespace, req.pages, pools[req.agent], ids);
    absl::Status rel =
        m.ok() && m->pin_id != 0 ? index->Release(kNamespace, m->pin_id) : absl::OkStatus();
    const auto end = SteadyClock::now();
    if (!m.ok() || !ins.ok() || !rel.ok()) {
      state.SkipWithError(
          absl::StrCat(m.status().ToString(), " / ", ins.status().ToString(), " / ", rel.ToString())
              .c_str());
      break;
    }
    requested += req.pages.size();
    matched += m->matched_pages;
    page_ops += 2 * req.pages.size() + ins->evicted_bytes / spec.BytesPerPage();
    lat.Add(end - start);
    state.SetIterationTime(Seconds(end - start));
  }
  const double seconds = lat.total_seconds();
  const double hit = static_cast<double>(matched) / std::max<uint64_t>(requested, 1);
  state.counters["page_ops_per_s"] = page_ops / seconds;
  state.counters["requests_per_s"] = lat.size() / seconds;
  state.counters["hit_ratio"] = hit;
  Summary().push_back(
      {name, absl::StrFormat("%s  %.2f M page-ops/s (target >= 2), %.0f requests/s, page hit ratio "
                             "%.3f at capacity %.0f%%",
                             PublishLatency(state, lat), page_ops / seconds / 1e6,
                             lat.size() / seconds, hit, 100 * capacity_fraction)});
}

}  // namespace

void BM_ReplayChat(benchmark::State& state, const std::string& name,
                   const ChatWorkloadOptions& workload, uint32_t window, double capacity_fraction) {
  const ChatWorkload w(workload, NamespaceKey());
  std::vector<ReplayRequest> requests;
  // Conversations run `window` at a time, their turns interleaved.
  for (uint32_t first = 0; first < w.conversations(); first += window) {
    const uint32_t last = std::min(first + window, w.conversations());
    for (uint32_t t = 0; t < w.options().turns; ++t) {
      for (uint32_t c = first; c < last; ++c) {
        requests.push_back({w.Context(c).first(w.TurnEnd(c, t)), c % w.options().agents});
      }
    }
  }
  RunReplay(state, name, DeepSeekV3Spec(), requests, w.options().agents, capacity_fraction);
}

// The trace's prompts that span at least one whole page, in trace order, all on one agent.
void BM_ReplayMooncake(benchmark::State& state, const std::string& name,
                       const std::vector<ReplayRequest>& requests) {
  ModelSpec spec = DeepSeekV3Spec();
  spec.page_size_tokens = kMooncakeBlockTokens;
  RunReplay(state, name, spec, requests, 1, 0.10);
}

// Memory per page-location of the index the whole trace builds when nothing is evicted:
// the trace's own tree shape (how many pages a radix node holds) instead of ChatWorkload's.
// Every request is inserted once, in trace order; the figure is timed as an insert rate.
// Only the heap figure is reported: RSS does not grow here, because the index reuses memory
// the benchmarks before it freed.
void BM_IndexBuildMooncake(benchmark::State& state, const std::string& name,
                           const std::vector<ReplayRequest>& requests) {
  ModelSpec spec = DeepSeekV3Spec();
  spec.page_size_tokens = kMooncakeBlockTokens;
  std::unique_ptr<CacheIndex> index = NewIndex(absl::ZeroDuration(), spec);
  const PoolKey pool{"agent-0", Tier::kGpu};
  BlockAllocator blocks;
  const uint64_t heap_before = HeapInUseBytes();
  double seconds = 0;
  uint64_t pages = 0;
  for (auto _ : state) {
    for (const ReplayRequest& req : requests) {
      std::span<const BlockId> ids = blocks.Next(0, req.pages.size());
      const auto start = SteadyClock::now();
      absl::StatusOr<InsertResult> r = index->Insert(kNamespace, req.pages, pool, ids);
      seconds += Seconds(SteadyClock::now() - start);
      if (!r.ok()) {
        state.SkipWithError(r.status().ToString().c_str());
        return;
      }
      pages += r->new_pages + r->replicated_pages;
    }
    state.SetIterationTime(seconds);
  }
  const double heap_delta = static_cast<double>(HeapInUseBytes()) - heap_before;
  const NamespaceStats s = index->Stats().namespaces.at(0);
  const double locations = static_cast<double>(std::max<uint64_t>(s.page_locations, 1));
  state.counters["pages"] = s.pages;
  state.counters["page_locations"] = s.page_locations;
  state.counters["radix_nodes"] = s.radix_nodes;
  state.counters["heap_B_per_location"] = heap_delta / locations;
  state.counters["insert_pages_per_s"] = pages / seconds;
  // What an agent restart costs the manager: forgetting the whole pool (under the index
  // lock, once), then sweeping its nodes out in the manager's steps of 256.
  const auto drop_start = SteadyClock::now();
  absl::StatusOr<DropPoolResult> dropped = index->DropPool(pool);
  const double drop_seconds = Seconds(SteadyClock::now() - drop_start);
  if (!dropped.ok()) {
    state.SkipWithError(dropped.status().ToString().c_str());
    return;
  }
  double sweep_seconds = 0, max_step_seconds = 0;
  uint64_t steps = 0;
  for (;;) {
    const auto step_start = SteadyClock::now();
    const SweepResult swept = index->SweepRetired(256);
    const double step = Seconds(SteadyClock::now() - step_start);
    sweep_seconds += step;
    max_step_seconds = std::max(max_step_seconds, step);
    ++steps;
    if (swept.removed_replicas < 256) break;
  }
  state.counters["drop_pool_us"] = drop_seconds * 1e6;
  state.counters["sweep_ms"] = sweep_seconds * 1e3;
  Summary().push_back(
      {name, absl::StrFormat("%d pages, %d page-locations, %d nodes (%.1f pages/node); heap %.1f "
                             "B/location (target <= 128); %.2f M pages/s",
                             s.pages, s.page_locations, s.radix_nodes,
                             s.pages / std::max(1.0, static_cast<double>(s.radix_nodes)),
                             heap_delta / locations, pages / seconds / 1e6)});
  Summary().push_back(
      {"DropPool/mooncake",
       absl::StrFormat("%d page-locations dropped in %.1f us; swept in %d steps of <= 256 "
                       "nodes, %.1f ms in all (%.3fx the inserts' time), longest step %.2f ms",
                       dropped->dropped_pages, drop_seconds * 1e6, steps, sweep_seconds * 1e3,
                       sweep_seconds / seconds, max_step_seconds * 1e3)});
}

}  // namespace kvcm::bench
