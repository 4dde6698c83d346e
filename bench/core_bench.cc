// kvcm_core_bench: the in-process CacheIndex against ARCHITECTURE.md section 10.
//
//   kvcm_core_bench [--smoke] [--trace=mooncake.jsonl] [google-benchmark flags]
//
// Benchmarks, in the order they run:
//   IndexBuild        builds the shared index (ChatWorkload, 1M+ page-locations, 8 agents)
//                     and reports RSS and heap bytes per page-location (target <= 128 B).
//   Match/<hit>/<mode> a 128-page prompt of precomputed page hashes against that index;
//                     hit = full | partial | miss, mode = probe (read-only) | touch (recency
//                     update) | pin (pin + lease; the Release after it is timed apart).
//                     Per-call p50/p99 (target p50 <= 1 us, p99 <= 5 us).
//   Insert/fresh      new 128-page conversations into the shared index (pages/s).
//   InsertEvict/...   inserts into a full pool so that every insert evicts (pages/s in and
//                     out), with the default 5-minute eviction-regret window and without;
//                     then times missing matches on that index (miss_match_*).
//   Replay/chat       match(pin) + insert + release per request on capacity-bound pools.
//   IndexBuild/mooncake, Replay/mooncake  with --trace: memory per page-location of the
//                     index a Mooncake trace builds, and the replay over that trace.
//   (The Replay and */mooncake benchmarks are in core_bench_replay.cc.)
//   A replay's page-ops are, per request, the prompt's pages looked up by Match + the
//   prompt's pages passed to Insert + the pages Insert evicted (target >= 2M/s, one core).
//
// Every timed figure is measured per call with std::chrono::steady_clock (its own cost,
// clock_overhead_ns, is included in each sample and printed first) and reported through
// manual time, so Google Benchmark's mean is the mean of the same samples. Each benchmark
// runs a fixed number of calls once; use --benchmark_repetitions=N for more runs.
// --smoke (or KVCM_BENCH_SMOKE set in the environment) shrinks everything so the whole
// binary runs in about a second (ctest kvcm_bench_smoke).
#include "bench/core_bench.h"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "bench/replay/trace.h"
#include "bench/smoke_flag.h"
#include "bench/workload.h"
#include "common/program_flags.h"
#include "server/core/cache_index.h"

namespace kvcm::bench {

// Every index of this binary derives namespace keys from the same secret, so one workload's
// page hashes are valid in all of them.
constexpr HashKey kSecret{0x6b76636d2d62656eULL, 0x63682d7365637265ULL};

std::vector<SummaryRow>& Summary() {
  static auto* rows = new std::vector<SummaryRow>();
  return *rows;
}

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string PublishLatency(benchmark::State& state, LatencyHistogram& h, absl::string_view prefix) {
  const double p50 = h.Percentile(0.50), p99 = h.Percentile(0.99);
  state.counters[absl::StrCat(prefix, "p50_ns")] = p50;
  state.counters[absl::StrCat(prefix, "p99_ns")] = p99;
  state.counters[absl::StrCat(prefix, "p999_ns")] = h.Percentile(0.999);
  state.counters[absl::StrCat(prefix, "max_ns")] = h.Percentile(1.0);
  return absl::StrFormat("%sp50 %.0f ns  %sp99 %.0f ns  %smean %.0f ns", prefix, p50, prefix, p99,
                         prefix, h.mean_ns());
}

std::unique_ptr<CacheIndex> NewIndex(absl::Duration regret_window, const ModelSpec& spec) {
  CacheIndexOptions options;
  options.hash_secret = kSecret;
  options.regret_window = regret_window;
  // Pools are sized explicitly where capacity matters; elsewhere nothing should evict.
  options.default_pool_capacity_bytes = ~uint64_t{0} / 2;
  auto index = std::make_unique<CacheIndex>(std::move(options));
  absl::StatusOr<RegisterModelResult> reg = index->RegisterModel(kNamespace, spec);
  if (!reg.ok()) {
    std::fprintf(stderr, "RegisterModel: %s\n", reg.status().ToString().c_str());
    std::abort();
  }
  return index;
}

HashKey NamespaceKey() { return DeriveNamespaceKey(kSecret, kNamespace.tenant, kNamespace.model); }

namespace {

// Sizes of one run. FullScale() is what docs/PERFORMANCE.md reports.
struct Scale {
  ChatWorkloadOptions shared;  // the 1M+ page-location index the matches run against
  int64_t match_calls;         // per Match benchmark
  uint32_t query_set;          // distinct partial-hit and miss prompts, cycled
  int64_t insert_calls;
  uint32_t evict_pool_pages;  // capacity of the InsertEvict pool, in pages
  int64_t evict_calls;
  ChatWorkloadOptions replay;  // Replay/chat workload
  uint32_t replay_window;      // conversations in flight together in Replay/chat
  double replay_capacity;      // pool capacity / pages the replay's pool would hold unbounded
};

Scale FullScale() {
  Scale s;
  // 64 system prompts x 224 conversations x 128 pages: ~1.06M distinct pages, ~1.09M
  // page-locations once system prompts are replicated on the 8 agents.
  s.shared = ChatWorkloadOptions{};
  s.match_calls = 200'000;
  s.query_set = 4'096;
  s.insert_calls = 20'000;
  // 8,192 DeepSeek-V3 pages = 36.8 GB of bf16 MLA KV: an H100's KV pool.
  s.evict_pool_pages = 8'192;
  s.evict_calls = 50'000;
  s.replay = ChatWorkloadOptions{.groups = 64, .conversations_per_group = 64};
  s.replay_window = 64;
  s.replay_capacity = 0.25;
  return s;
}

Scale SmokeScale() {
  Scale s;
  s.shared = ChatWorkloadOptions{.groups = 6, .conversations_per_group = 6};
  s.match_calls = 2'000;
  s.query_set = 64;
  s.insert_calls = 200;
  s.evict_pool_pages = 512;
  s.evict_calls = 200;
  s.replay = ChatWorkloadOptions{.groups = 6, .conversations_per_group = 6};
  s.replay_window = 8;
  s.replay_capacity = 0.25;
  return s;
}

Scale g_scale = FullScale();
std::string g_trace_path;
double g_clock_overhead_ns = 0;

// A prompt the Match benchmarks send, and the agent that sends it.
struct Query {
  std::span<const PageHash> pages;
  uint32_t agent = 0;
};

// The 1M+ page-location index every Match and Insert/fresh call runs against, built on
// first use. Lives until exit.
class SharedIndex {
 public:
  static SharedIndex& Get() {
    static SharedIndex* shared = new SharedIndex();
    return *shared;
  }

  CacheIndex& index() { return *index_; }
  const ChatWorkload& workload() const { return workload_; }
  const BuildResult& build() const { return build_; }
  uint64_t rss_delta() const { return rss_after_ - rss_before_; }
  uint64_t heap_delta() const { return heap_after_ - heap_before_; }
  const NamespaceStats& stats() const { return stats_; }

  enum class Hit { kFull, kPartial, kMiss };
  // The i-th query of a kind; queries cycle in a fixed random order over the whole index.
  Query query(Hit hit, uint64_t i) const {
    if (hit == Hit::kFull) {
      const uint32_t c = full_order_[i % full_order_.size()];
      return Query{workload_.Context(c), c % agents()};
    }
    const std::vector<Stored>& set = hit == Hit::kPartial ? partial_ : miss_;
    const Stored& q = set[i % set.size()];
    return Query{q.pages, q.agent};
  }
  uint32_t agents() const { return static_cast<uint32_t>(workload_.pools().size()); }

 private:
  struct Stored {
    std::vector<PageHash> pages;
    uint32_t agent;
  };

  SharedIndex()
      : index_(NewIndex(absl::Minutes(5), DeepSeekV3Spec())),
        workload_(g_scale.shared, NamespaceKey()) {
    uint64_t state = 42;
    const uint32_t n = workload_.conversations();
    for (uint32_t i = 0; i < std::max(n, g_scale.query_set); ++i) {
      full_order_.push_back(static_cast<uint32_t>(SplitMix64(state) % n));
    }
    for (uint32_t i = 0; i < g_scale.query_set; ++i) {
      const uint32_t c = static_cast<uint32_t>(SplitMix64(state) % n);
      const uint32_t t = static_cast<uint32_t>(SplitMix64(state) % g_scale.shared.turns);
      // Diverge right after the system prompt or after one of the first turns.
      const uint32_t shared = t == 0 ? workload_.PrefixPages(c) : workload_.TurnEnd(c, t - 1);
      partial_.push_back(Stored{workload_.Diverging(c, shared, 2 * i), c % agents()});
      miss_.push_back(Stored{workload_.Diverging(c, 0, 2 * i + 1), c % agents()});
    }
    rss_before_ = ResidentBytes();
    heap_before_ = HeapInUseBytes();
    absl::StatusOr<BuildResult> build = BuildIndex(workload_, kNamespace, *index_);
    if (!build.ok()) {
      std::fprintf(stderr, "BuildIndex: %s\n", build.status().ToString().c_str());
      std::abort();
    }
    build_ = *build;
    rss_after_ = ResidentBytes();
    heap_after_ = HeapInUseBytes();
    stats_ = index_->Stats().namespaces.at(0);
  }

  std::unique_ptr<CacheIndex> index_;
  ChatWorkload workload_;
  std::vector<uint32_t> full_order_;
  std::vector<Stored> partial_, miss_;
  BuildResult build_;
  NamespaceStats stats_;
  uint64_t rss_before_ = 0, rss_after_ = 0, heap_before_ = 0, heap_after_ = 0;
};

void BM_IndexBuild(benchmark::State& state, const std::string& name) {
  SharedIndex& shared = SharedIndex::Get();
  for (auto _ : state) state.SetIterationTime(shared.build().seconds);
  const NamespaceStats& s = shared.stats();
  const double locations = static_cast<double>(s.page_locations);
  const double rss_per = shared.rss_delta() / locations;
  const double heap_per = shared.heap_delta() / locations;
  const double pages_per_s = shared.build().inserted_pages / shared.build().seconds;
  state.counters["pages"] = s.pages;
  state.counters["page_locations"] = locations;
  state.counters["radix_nodes"] = s.radix_nodes;
  state.counters["rss_B_per_location"] = rss_per;
  state.counters["heap_B_per_location"] = heap_per;
  state.counters["insert_pages_per_s"] = pages_per_s;
  state.counters["inserts_per_s"] = shared.build().inserts / shared.build().seconds;
  Summary().push_back(
      {"IndexBuild",
       absl::StrFormat("%d pages, %d page-locations, %d nodes; RSS %.1f B/location, heap "
                       "%.1f B/location (target <= 128); build %.2f M pages/s",
                       s.pages, s.page_locations, s.radix_nodes, rss_per, heap_per,
                       pages_per_s / 1e6)});
}

enum class Mode { kProbe, kTouch, kPin };

void BM_Match(benchmark::State& state, const std::string& name, SharedIndex::Hit hit, Mode mode) {
  SharedIndex& shared = SharedIndex::Get();
  CacheIndex& index = shared.index();
  std::vector<MatchOptions> by_agent(shared.agents());
  for (uint32_t a = 0; a < by_agent.size(); ++a) {
    by_agent[a].requester_agent_id = shared.workload().pools()[a].agent_id;
    by_agent[a].probe = mode == Mode::kProbe;
    by_agent[a].pin = mode == Mode::kPin;
  }
  LatencyHistogram match, release;
  match.Reserve(state.max_iterations);
  if (mode == Mode::kPin) release.Reserve(state.max_iterations);
  uint64_t i = 0, matched = 0, requested = 0;
  for (auto _ : state) {
    const Query q = shared.query(hit, i++);
    PinId pin = 0;
    const auto start = SteadyClock::now();
    {
      // The result is destroyed inside the timed region: freeing it is part of a call.
      absl::StatusOr<MatchResult> r = index.Match(kNamespace, q.pages, by_agent[q.agent]);
      benchmark::DoNotOptimize(r);
      if (r.ok()) {
        matched += r->matched_pages;
        pin = r->pin_id;
      } else {
        state.SkipWithError(r.status().ToString().c_str());
        break;
      }
    }
    const auto end = SteadyClock::now();
    match.Add(end - start);
    state.SetIterationTime(Seconds(end - start));
    requested += q.pages.size();
    if (pin != 0) {
      const auto release_start = SteadyClock::now();
      absl::Status s = index.Release(kNamespace, pin);
      release.Add(SteadyClock::now() - release_start);
      if (!s.ok()) {
        state.SkipWithError(s.ToString().c_str());
        break;
      }
    }
  }
  const double calls = static_cast<double>(std::max<uint64_t>(i, 1));
  std::string figures = PublishLatency(state, match);
  if (release.size() > 0) {
    absl::StrAppend(&figures, "  | ", PublishLatency(state, release, "release_"));
  }
  absl::StrAppend(&figures, absl::StrFormat("  matched %.1f of %.0f pages", matched / calls,
                                            requested / calls));
  state.counters["matched_pages_avg"] = matched / calls;
  state.counters["clock_overhead_ns"] = g_clock_overhead_ns;
  Summary().push_back({name, figures});
}

// Inserts a new conversation per call: a random system prompt followed by fresh pages,
// into the agent of that system prompt's conversation. Runs against the shared index,
// which grows by about 74 pages per call.
void BM_InsertFresh(benchmark::State& state, const std::string& name) {
  SharedIndex& shared = SharedIndex::Get();
  CacheIndex& index = shared.index();
  const ChatWorkload& w = shared.workload();
  BlockAllocator blocks;
  LatencyHistogram lat;
  lat.Reserve(state.max_iterations);
  uint64_t seed = 1'000'000'007, pages = 0;
  for (auto _ : state) {
    const uint32_t c = static_cast<uint32_t>(SplitMix64(seed) % w.conversations());
    const std::vector<PageHash> prompt = w.Diverging(c, w.PrefixPages(c), seed);
    std::span<const BlockId> ids = blocks.Next(c % shared.agents(), prompt.size());
    const auto start = SteadyClock::now();
    absl::StatusOr<InsertResult> r = index.Insert(kNamespace, prompt, w.PoolOf(c), ids);
    const auto end = SteadyClock::now();
    if (!r.ok()) {
      state.SkipWithError(r.status().ToString().c_str());
      break;
    }
    pages += r->new_pages + r->replicated_pages;
    lat.Add(end - start);
    state.SetIterationTime(Seconds(end - start));
  }
  const double pages_per_s = pages / lat.total_seconds();
  state.counters["pages_per_s"] = pages_per_s;
  state.counters["inserts_per_s"] = lat.size() / lat.total_seconds();
  Summary().push_back(
      {name, absl::StrFormat("%s  %.2f M pages/s", PublishLatency(state, lat), pages_per_s / 1e6)});
}

// Every call inserts a new conversation into one pool kept full, so every call evicts
// (exactly the shortfall, rounded up to whole radix nodes, LRU order).
void BM_InsertEvict(benchmark::State& state, const std::string& name,
                    absl::Duration regret_window) {
  const ModelSpec spec = DeepSeekV3Spec();
  std::unique_ptr<CacheIndex> index = NewIndex(regret_window, spec);
  const ChatWorkload w(ChatWorkloadOptions{.groups = 64, .conversations_per_group = 1},
                       NamespaceKey());
  const PoolKey pool{"agent-0", Tier::kGpu};
  if (absl::Status s =
          index->SetPoolCapacity(pool, uint64_t{g_scale.evict_pool_pages} * spec.BytesPerPage());
      !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }
  BlockAllocator blocks;
  uint64_t seed = 7;
  auto insert_next = [&](InsertResult* out) {
    const uint32_t c = static_cast<uint32_t>(SplitMix64(seed) % w.conversations());
    const std::vector<PageHash> prompt = w.Diverging(c, w.PrefixPages(c), seed);
    std::span<const BlockId> ids = blocks.Next(0, prompt.size());
    const auto start = SteadyClock::now();
    absl::StatusOr<InsertResult> r = index->Insert(kNamespace, prompt, pool, ids);
    const auto end = SteadyClock::now();
    if (r.ok()) *out = *r;
    return r.ok() ? std::optional(end - start) : std::nullopt;
  };
  // Fill the pool to capacity first (not timed).
  for (InsertResult r; r.evicted_bytes == 0;) {
    if (!insert_next(&r)) {
      state.SkipWithError("fill insert failed");
      return;
    }
  }
  const uint64_t heap_before = HeapInUseBytes();
  LatencyHistogram lat;
  lat.Reserve(state.max_iterations);
  uint64_t inserted = 0, evicted = 0;
  for (auto _ : state) {
    InsertResult r;
    std::optional<SteadyClock::duration> d = insert_next(&r);
    if (!d) {
      state.SkipWithError("insert failed");
      break;
    }
    inserted += r.new_pages + r.replicated_pages;
    evicted += r.evicted_bytes / spec.BytesPerPage();
    lat.Add(*d);
    state.SetIterationTime(Seconds(*d));
  }
  const double heap_growth = static_cast<double>(HeapInUseBytes()) - heap_before;
  const double seconds = lat.total_seconds();
  const double heap_per_evicted = heap_growth / std::max<uint64_t>(evicted, 1);

  // Matches that miss, after all that eviction: with a regret window every missed page is
  // looked up among the recently evicted ones (not timed into the insert figures above).
  std::vector<std::vector<PageHash>> misses;
  for (uint32_t k = 0; k < 256; ++k) {
    misses.push_back(w.Diverging(k % w.conversations(), 0, 1'000'000 + k));
  }
  LatencyHistogram miss_lat;
  miss_lat.Reserve(g_scale.match_calls / 10);
  const MatchOptions touch;
  for (int64_t k = 0; k < g_scale.match_calls / 10; ++k) {
    const auto start = SteadyClock::now();
    absl::StatusOr<MatchResult> r = index->Match(kNamespace, misses[k % misses.size()], touch);
    benchmark::DoNotOptimize(r);
    miss_lat.Add(SteadyClock::now() - start);
  }

  state.counters["inserted_pages_per_s"] = inserted / seconds;
  state.counters["evicted_pages_per_s"] = evicted / seconds;
  state.counters["heap_B_per_evicted_page"] = heap_per_evicted;
  const std::string miss_figures = PublishLatency(state, miss_lat, "miss_match_");
  Summary().push_back(
      {name, absl::StrFormat("%s  in %.2f M pages/s, evicted %.2f M pages/s, heap growth %.1f B "
                             "per evicted page (%.0f MiB); then %s",
                             PublishLatency(state, lat), inserted / seconds / 1e6,
                             evicted / seconds / 1e6, heap_per_evicted, heap_growth / (1 << 20),
                             miss_figures)});
}

int Main(int argc, char** argv) {
  HandleHelpAndVersion(argc, argv, "kvcm_core_bench", "");
  // As kvcm-manager does: Debian's Abseil otherwise runs its deadlock detector on every lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::vector<char*> rest;
  const bool smoke = bench::TakeSmokeFlag(argc, argv, &rest);
  std::vector<char*> args;
  for (char* a : rest) {
    absl::string_view arg(a);
    if (absl::ConsumePrefix(&arg, "--trace=")) {
      g_trace_path = std::string(arg);
    } else {
      args.push_back(a);
    }
  }
  if (smoke) g_scale = SmokeScale();
  int bench_argc = static_cast<int>(args.size());
  benchmark::Initialize(&bench_argc, args.data());
  if (benchmark::ReportUnrecognizedArguments(bench_argc, args.data())) return 2;

  g_clock_overhead_ns = SteadyClockOverheadNs();
  std::printf("kvcm_core_bench%s: %s, steady_clock pair %.0f ns\n", smoke ? " --smoke" : "",
              MachineSummary().c_str(), g_clock_overhead_ns);

  // Registers `fn(state, name, args...)` under `name`, run once for `iterations` calls.
  auto add = [](const std::string& name, int64_t iterations, benchmark::TimeUnit unit, auto fn,
                auto... args) {
    return benchmark::RegisterBenchmark(name.c_str(),
                                        [=](benchmark::State& state) { fn(state, name, args...); })
        ->Iterations(iterations)
        ->UseManualTime()
        ->Unit(unit);
  };
  add("IndexBuild", 1, benchmark::kMillisecond, BM_IndexBuild)->Repetitions(1);
  using Hit = SharedIndex::Hit;
  const std::pair<const char*, Hit> hits[] = {
      {"full", Hit::kFull}, {"partial", Hit::kPartial}, {"miss", Hit::kMiss}};
  const std::pair<const char*, Mode> modes[] = {
      {"probe", Mode::kProbe}, {"touch", Mode::kTouch}, {"pin", Mode::kPin}};
  for (const auto& [hit_name, hit] : hits) {
    for (const auto& [mode_name, mode] : modes) {
      add(absl::StrCat("Match/", hit_name, "/", mode_name), g_scale.match_calls,
          benchmark::kNanosecond, BM_Match, hit, mode);
    }
  }
  add("Insert/fresh", g_scale.insert_calls, benchmark::kMicrosecond, BM_InsertFresh);
  add("InsertEvict/regret_5m", g_scale.evict_calls, benchmark::kMicrosecond, BM_InsertEvict,
      absl::Minutes(5));
  add("InsertEvict/regret_off", g_scale.evict_calls, benchmark::kMicrosecond, BM_InsertEvict,
      absl::ZeroDuration());
  add("Replay/chat",
      int64_t{g_scale.replay.groups} * g_scale.replay.conversations_per_group *
          g_scale.replay.turns,
      benchmark::kMicrosecond, BM_ReplayChat, g_scale.replay, g_scale.replay_window,
      g_scale.replay_capacity);
  // Whole pages only: the partial last block of a prompt is never cached.
  Trace trace;
  std::vector<ReplayRequest> trace_requests;
  if (!g_trace_path.empty()) {
    absl::StatusOr<Trace> read = ReadMooncakeTrace(g_trace_path);
    if (!read.ok()) {
      std::fprintf(stderr, "%s\n", read.status().ToString().c_str());
      return 2;
    }
    trace = std::move(*read);
    for (const TraceRequest& r : trace.requests) {
      if (!r.pages.empty()) trace_requests.push_back({r.pages, 0});
    }
    if (smoke) trace_requests.resize(std::min<size_t>(trace_requests.size(), 500));
    add("IndexBuild/mooncake", 1, benchmark::kMillisecond, BM_IndexBuildMooncake,
        std::cref(trace_requests))
        ->Repetitions(1);
    add("Replay/mooncake", trace_requests.size(), benchmark::kMicrosecond, BM_ReplayMooncake,
        std::cref(trace_requests));
  }

  // Google Benchmark writes its context to stderr and rows to stdout; keep them in order.
  std::fflush(stdout);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf("\nSummary (latencies per call; clock overhead %.0f ns included)\n",
              g_clock_overhead_ns);
  for (const SummaryRow& row : Summary()) {
    std::printf("  %-28s %s\n", row.name.c_str(), row.figures.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) { return kvcm::bench::Main(argc, argv); }