#include "bench/workload.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <numeric>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvcm::bench {
namespace {

// DeepSeek-V3's vocabulary size: token ids are drawn from [0, kVocab).
constexpr uint64_t kVocab = 129'280;

// System-prompt lengths as fractions of a prompt, in 1/32 of prompt_pages: 4, 16, 32, 64,
// 96 and 112 pages of a 128-page prompt, so matches stop at very different depths.
constexpr uint32_t kPrefixThirtySeconds[] = {1, 4, 8, 16, 24, 28};

// Seeds of the three token streams, so that no two streams share token ids by design.
constexpr uint64_t kGroupStream = 0x47524f5550000000ULL;  // "GROUP"
constexpr uint64_t kConvStream = 0x434f4e5600000000ULL;   // "CONV"
constexpr uint64_t kFreshStream = 0x4652455348000000ULL;  // "FRESH"

void FillTokens(uint64_t seed, std::span<int32_t> out) {
  uint64_t state = seed;
  for (int32_t& t : out) t = static_cast<int32_t>(SplitMix64(state) % kVocab);
}

}  // namespace

ModelSpec DeepSeekV3Spec() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .dtype = KvDtype::kBf16,
                   .page_size_tokens = kDefaultPageSizeTokens};
}

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

ChatWorkload::ChatWorkload(const ChatWorkloadOptions& options, const HashKey& key)
    : options_(options), key_(key) {
  const uint32_t p = options_.prompt_pages;
  const uint32_t tokens_per_page = options_.page_size_tokens;
  const uint32_t n = options_.groups * options_.conversations_per_group;
  contexts_.reserve(size_t{n} * p);
  prefix_pages_.reserve(n);
  for (uint32_t a = 0; a < options_.agents; ++a) {
    pools_.push_back(PoolKey{absl::StrCat("agent-", a), Tier::kGpu});
  }

  std::vector<int32_t> tokens(size_t{p} * tokens_per_page);
  for (uint32_t g = 0; g < options_.groups; ++g) {
    const uint32_t prefix = std::clamp<uint32_t>(
        p * kPrefixThirtySeconds[g % std::size(kPrefixThirtySeconds)] / 32, 1, p - 1);
    distinct_pages_ += prefix;
    std::span<int32_t> all(tokens);
    FillTokens(options_.seed ^ kGroupStream ^ g, all.first(size_t{prefix} * tokens_per_page));
    for (uint32_t i = 0; i < options_.conversations_per_group; ++i) {
      const uint32_t c = g * options_.conversations_per_group + i;
      FillTokens(options_.seed ^ kConvStream ^ c, all.subspan(size_t{prefix} * tokens_per_page));
      std::vector<PageHash> hashes = HashPages(key_, tokens, tokens_per_page);
      contexts_.insert(contexts_.end(), hashes.begin(), hashes.end());
      prefix_pages_.push_back(prefix);
      distinct_pages_ += p - prefix;
    }
  }
}

uint32_t ChatWorkload::TurnEnd(uint32_t c, uint32_t t) const {
  const uint32_t prefix = prefix_pages_[c];
  const uint32_t rest = options_.prompt_pages - prefix;
  // ceil((t + 1) * rest / turns): every turn adds at least one page when rest >= turns.
  return prefix + ((t + 1) * rest + options_.turns - 1) / options_.turns;
}

void ChatWorkload::FreshPages(PageHash prev, uint64_t fresh_seed, std::span<PageHash> out) const {
  std::vector<int32_t> tokens(options_.page_size_tokens);
  uint64_t seed = options_.seed ^ kFreshStream ^ (fresh_seed * 0x9e3779b97f4a7c15ULL);
  for (PageHash& page : out) {
    FillTokens(SplitMix64(seed), tokens);
    page = HashPage(key_, prev, tokens);
    prev = page;
  }
}

std::vector<PageHash> ChatWorkload::Diverging(uint32_t c, uint32_t shared_pages,
                                              uint64_t fresh_seed) const {
  std::span<const PageHash> context = Context(c);
  std::vector<PageHash> prompt(context.begin(), context.begin() + shared_pages);
  prompt.resize(options_.prompt_pages);
  FreshPages(shared_pages == 0 ? PageHash{} : prompt[shared_pages - 1], fresh_seed,
             std::span<PageHash>(prompt).subspan(shared_pages));
  return prompt;
}

std::span<const BlockId> BlockAllocator::Next(uint32_t pool_index, uint32_t pages) {
  if (pool_index >= next_.size()) next_.resize(pool_index + 1, 0);
  scratch_.resize(pages);
  // Block ids wrap at 2^32, as a real pool's ids are reused after frees.
  std::iota(scratch_.begin(), scratch_.end(), next_[pool_index]);
  next_[pool_index] += pages;
  return scratch_;
}

absl::StatusOr<BuildResult> BuildIndex(const ChatWorkload& workload, const NamespaceId& ns,
                                       CacheIndex& index) {
  BuildResult result;
  BlockAllocator blocks;
  const uint32_t agents = static_cast<uint32_t>(workload.pools().size());
  for (uint32_t t = 0; t < workload.options().turns; ++t) {
    for (uint32_t c = 0; c < workload.conversations(); ++c) {
      std::span<const PageHash> prompt = workload.Context(c).first(workload.TurnEnd(c, t));
      std::span<const BlockId> ids = blocks.Next(c % agents, prompt.size());
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<InsertResult> r = index.Insert(ns, prompt, workload.PoolOf(c), ids);
      result.seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!r.ok()) return r.status();
      ++result.inserts;
      result.inserted_pages += r->new_pages + r->replicated_pages;
    }
  }
  return result;
}

uint64_t ResidentBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, "VmRSS:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    uint64_t kib = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) return kib * 1024;
  }
  return 0;
}

uint64_t HeapInUseBytes() {
  struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

double LatencyHistogram::total_seconds() const {
  return std::accumulate(samples_ns_.begin(), samples_ns_.end(), 0.0) * 1e-9;
}

double LatencyHistogram::mean_ns() const {
  return samples_ns_.empty() ? 0 : total_seconds() * 1e9 / samples_ns_.size();
}

double LatencyHistogram::Percentile(double q) {
  if (samples_ns_.empty()) return 0;
  if (!sorted_) {
    std::sort(samples_ns_.begin(), samples_ns_.end());
    sorted_ = true;
  }
  // Nearest rank: the smallest sample with at least q of the samples at or below it.
  const size_t rank = static_cast<size_t>(std::ceil(q * samples_ns_.size()));
  return static_cast<double>(samples_ns_[std::clamp<size_t>(rank, 1, samples_ns_.size()) - 1]);
}

double SteadyClockOverheadNs() {
  LatencyHistogram h;
  constexpr int kSamples = 10'001;
  h.Reserve(kSamples);
  for (int i = 0; i < kSamples; ++i) {
    const auto a = std::chrono::steady_clock::now();
    const auto b = std::chrono::steady_clock::now();
    h.Add(b - a);
  }
  return h.Percentile(0.5);
}

double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

std::string MachineSummary() {
  std::string model = "unknown";
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, "model name")) continue;
    std::vector<std::string> parts = absl::StrSplit(rest, absl::MaxSplits(':', 1));
    if (parts.size() == 2) model = std::string(absl::StripAsciiWhitespace(parts[1]));
    break;
  }
  std::string load = "unknown";
  std::ifstream loadavg("/proc/loadavg");
  if (std::getline(loadavg, line)) {
    std::vector<std::string> parts = absl::StrSplit(line, ' ');
    if (parts.size() >= 3) load = absl::StrCat(parts[0], " ", parts[1], " ", parts[2]);
  }
  std::string mem = "unknown";
  std::ifstream meminfo("/proc/meminfo");
  while (std::getline(meminfo, line)) {
    absl::string_view rest(line);
    if (absl::ConsumePrefix(&rest, "MemTotal:")) {
      mem = std::string(absl::StripAsciiWhitespace(rest));
      break;
    }
  }
  return absl::StrCat("cpus=", std::thread::hardware_concurrency(), " model=\"", model,
                      "\" mem=", mem, " loadavg(1/5/15m)=", load);
}

}  // namespace kvcm::bench
