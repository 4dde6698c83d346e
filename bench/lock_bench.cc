// kvcm_lock_bench: CacheIndex's lock in process, without gRPC: reader threads matching
// beside a writer thread that inserts (and so evicts), closed loop, for a fixed time.
//
//   kvcm_lock_bench [--readers=2] [--reader=probe|match|route] [--writer=insert|none]
//                   [--seconds=5] [--smoke]
//
// The workload is kvcm-load's: DeepSeek-V3 (64-token pages), 32 shared prefixes of 8 pages
// with 32 prompts of 24 more pages behind each, 4 index-only pools of 64 GiB (they hold
// about 61,000 of the 99,328 page-locations the inserts reach, so inserts evict once the
// pools are full); every prompt is inserted once into one pool before the clock starts.
// reader: probe (Match with probe), match (counting Match, no pin), route (a probe then a
// counting match, what the manager's Route does). Prints each role's calls/s and per-call
// latency p50 / p99 / p99.9 (steady_clock around each call).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/model_catalog.h"
#include "common/program_flags.h"
#include "server/core/cache_index.h"

namespace kvcm {
namespace {

using SteadyClock = std::chrono::steady_clock;

struct Args {
  int readers = 2;
  std::string reader = "probe";
  std::string writer = "insert";
  double seconds = 5;
};

struct Samples {
  std::vector<int64_t> ns;
  void Report(const char* role, double seconds) {
    std::sort(ns.begin(), ns.end());
    auto at = [&](double q) {
      return ns.empty() ? 0 : ns[std::min(ns.size() - 1, static_cast<size_t>(q * ns.size()))];
    };
    std::printf("%-8s %10zu calls %10.0f calls/s  p50 %7lld ns  p99 %8lld ns  p99.9 %8lld ns\n",
                role, ns.size(), ns.size() / seconds, static_cast<long long>(at(0.5)),
                static_cast<long long>(at(0.99)), static_cast<long long>(at(0.999)));
  }
};

int Run(const Args& args) {
  const NamespaceId ns{"kvcm-lock-bench", "deepseek-v3"};
  ModelSpec spec = *FindModel("deepseek-v3");
  spec.page_size_tokens = 64;
  CacheIndexOptions options;
  options.hash_secret = HashKey{1, 2};
  CacheIndex index(options);
  if (!index.RegisterModel(ns, spec).ok()) return 1;
  std::vector<std::vector<PageHash>> prompts;
  for (int32_t prefix = 0; prefix < 32; ++prefix) {
    for (int32_t p = 0; p < 32; ++p) {
      std::vector<int32_t> tokens;
      for (int32_t page = 0; page < 32; ++page) {
        const int32_t id =
            page < 8 ? prefix * 100 + page : 1'000'000 + (prefix * 32 + p) * 100 + page;
        tokens.insert(tokens.end(), spec.page_size_tokens, id);
      }
      prompts.push_back(*index.HashTokens(ns, tokens));
    }
  }
  const PoolKey pools[] = {{"pool-0", Tier::kGpu},
                           {"pool-1", Tier::kGpu},
                           {"pool-2", Tier::kGpu},
                           {"pool-3", Tier::kGpu}};
  std::vector<BlockId> blocks(32);
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (!index.Insert(ns, prompts[i], pools[i % 4], blocks).ok()) return 1;
  }

  std::atomic<bool> stop{false};
  std::vector<Samples> samples(args.readers + 1);
  auto timed = [&](Samples& s, auto&& call) {
    const auto start = SteadyClock::now();
    const bool ok = call();
    s.ns.push_back(
        std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - start).count());
    return ok;
  };
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < args.readers; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937_64 rng(r + 1);
      Samples& s = samples[r];
      s.ns.reserve(4'000'000);
      while (!stop.load(std::memory_order_relaxed)) {
        const std::vector<PageHash>& pages = prompts[rng() % prompts.size()];
        const bool ok = timed(s, [&] {
          if (args.reader == "match") return index.Match(ns, pages, {}).ok();
          if (!index.Match(ns, pages, {.probe = true}).ok()) return false;
          return args.reader == "probe" ||
                 index.Match(ns, pages, {.requester_agent_id = "pool-0"}).ok();
        });
        if (!ok) ++failures;
      }
    });
  }
  if (args.writer == "insert") {
    threads.emplace_back([&] {
      std::mt19937_64 rng(99);
      Samples& s = samples[args.readers];
      s.ns.reserve(4'000'000);
      while (!stop.load(std::memory_order_relaxed)) {
        const std::vector<PageHash>& pages = prompts[rng() % prompts.size()];
        const PoolKey& pool = pools[rng() % 4];
        if (!timed(s, [&] { return index.Insert(ns, pages, pool, blocks).ok(); })) ++failures;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(args.seconds));
  stop = true;
  for (std::thread& t : threads) t.join();
  std::printf("kvcm_lock_bench: readers %d (%s), writer %s, %.1f s, %u cpus\n", args.readers,
              args.reader.c_str(), args.writer.c_str(), args.seconds,
              std::thread::hardware_concurrency());
  Samples all_readers;
  for (int r = 0; r < args.readers; ++r) {
    all_readers.ns.insert(all_readers.ns.end(), samples[r].ns.begin(), samples[r].ns.end());
  }
  all_readers.Report(args.reader.c_str(), args.seconds);
  if (args.writer == "insert") samples[args.readers].Report("insert", args.seconds);
  const IndexCounters counters = index.Stats().counters;
  std::printf("index: %llu page-locations inserted, %llu evicted\n",
              static_cast<unsigned long long>(counters.inserted_pages),
              static_cast<unsigned long long>(counters.evicted_pages));
  if (failures > 0) {
    std::fprintf(stderr, "kvcm_lock_bench: %d calls failed\n", failures.load());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvcm

int main(int argc, char** argv) {
  kvcm::HandleHelpAndVersion(
      argc, argv, "kvcm_lock_bench",
      "kvcm_lock_bench [--readers=N] [--reader=probe|match|route] [--writer=insert|none] "
      "[--seconds=S] [--smoke]: CacheIndex readers beside an inserting writer, in process");
  kvcm::Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      return a.compare(0, n, flag) == 0 ? a.c_str() + n : nullptr;
    };
    if (const char* v = value("--readers=")) {
      if (!absl::SimpleAtoi(v, &args.readers) || args.readers < 0) return 2;
    } else if (const char* v = value("--reader=")) {
      args.reader = v;
    } else if (const char* v = value("--writer=")) {
      args.writer = v;
    } else if (const char* v = value("--seconds=")) {
      if (!absl::SimpleAtod(v, &args.seconds)) return 2;
    } else if (a == "--smoke") {
      args.seconds = 0.3;
    } else {
      std::fprintf(stderr,
                   "usage: kvcm_lock_bench [--readers=N] [--reader=probe|match|route] "
                   "[--writer=insert|none] [--seconds=S] [--smoke]\n");
      return 2;
    }
  }
  if (args.reader != "probe" && args.reader != "match" && args.reader != "route") return 2;
  if (args.writer != "insert" && args.writer != "none") return 2;
  return kvcm::Run(args);
}
