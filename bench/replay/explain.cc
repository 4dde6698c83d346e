#include "bench/replay/explain.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvcm::bench {
namespace {

// One way of classing a page, with its bucket labels.
struct Dimension {
  const char* name;
  std::vector<std::string> buckets;
};

enum Dim : size_t { kDepth, kReuse, kGap, kPopularity, kKind, kDims };

const std::array<Dimension, kDims>& Dimensions() {
  static const auto* dims = new std::array<Dimension, kDims>{{
      {"depth in the prompt (pages)", {"1", "2-3", "4-7", "8-15", "16-31", "32-63", "64+"}},
      {"earlier uses of the page", {"1", "2", "3-4", "5-8", "9-16", "17+"}},
      {"time since its last use",
       {"< 30 s", "30-60 s", "1-2 min", "2-4 min", "4-8 min", "8-16 min", "16+ min"}},
      {"pages that followed it before (fan-out)", {"0", "1", "2-3", "4-15", "16+"}},
      {"what the request is to the page's last user",
       {"its next turn (extends its whole prompt)", "another prompt sharing the prefix"}},
  }};
  return *dims;
}

// Power-of-two bucket of n >= 1: 1, 2-3, 4-7, ... capped at `last`.
size_t Log2Bucket(uint64_t n, size_t last) {
  return std::min<size_t>(std::bit_width(std::max<uint64_t>(n, 1)) - 1, last);
}

size_t UsesBucket(uint64_t uses) {
  if (uses <= 2) return uses - 1;
  return std::min<size_t>(std::bit_width(uses - 1), 5);  // 3-4, 5-8, 9-16, 17+
}

size_t GapBucket(double seconds) {
  if (seconds < 30) return 0;
  if (seconds < 60) return 1;
  return std::min<size_t>(2 + Log2Bucket(static_cast<uint64_t>(seconds / 60), 4), 6);
}

size_t FanoutBucket(uint64_t n) {
  if (n <= 1) return n;
  if (n <= 3) return 2;
  return n <= 15 ? 3 : 4;
}

struct PageState {
  uint32_t uses = 0;
  uint32_t fanout = 0;
  uint32_t last_request = 0;
  double last_ms = 0;
};

struct PairHash {
  size_t operator()(const std::pair<PageHash, PageHash>& p) const {
    return p.first.lo ^ (p.second.lo * 0x9E3779B97F4A7C15ULL);
  }
};

// Per dimension and bucket: prompt pages, and per capacity lru hits, opt hits and the pages
// in the gap (opt hit, lru missed, minus the other way round).
struct Tally {
  uint64_t pages = 0;
  std::vector<int64_t> lru, opt, gap;
};

// ROC AUC of scoring each request by its class's continuation rate (in-sample): the chance
// that a continued request outranks one that is not, ties counting half.
double ClassAuc(const std::vector<bool>& extended, const std::vector<uint32_t>& turn,
                const std::vector<uint32_t>& added) {
  absl::flat_hash_map<uint32_t, std::pair<uint64_t, uint64_t>> by_class;  // (continued, not)
  for (size_t i = 0; i < extended.size(); ++i) {
    const uint32_t cls = std::min(turn[i], 4u) * 8 + static_cast<uint32_t>(Log2Bucket(added[i], 7));
    (extended[i] ? by_class[cls].first : by_class[cls].second) += 1;
  }
  std::vector<std::pair<uint64_t, uint64_t>> classes;
  for (const auto& [cls, counts] : by_class) classes.push_back(counts);
  std::sort(classes.begin(), classes.end(), [](const auto& a, const auto& b) {
    return a.first * (b.first + b.second) < b.first * (a.first + a.second);  // by rate
  });
  double pos = 0, neg = 0, below = 0, wins = 0;
  for (const auto& [p, n] : classes) {
    wins += p * (below + 0.5 * n);
    below += n;
    pos += p;
    neg += n;
  }
  return pos > 0 && neg > 0 ? wins / (pos * neg) : 0.5;
}

}  // namespace

absl::Status RunExplain(const Trace& trace, const ExplainOptions& options) {
  const size_t caps = options.capacities.size();
  std::vector<std::vector<uint32_t>> lru_hits(caps), opt_hits(caps);
  // Token hit rates per capacity, by policy.
  constexpr const char* kPolicies[] = {"lru", "conversation", "opt-whether", "opt"};
  std::vector<std::array<double, std::size(kPolicies)>> rates(caps);
  for (size_t c = 0; c < caps; ++c) {
    for (size_t k = 0; k < std::size(kPolicies); ++k) {
      const std::string policy = kPolicies[k];
      ReplayOptions o = options.base;
      o.policy = policy;
      o.gpus = 1;
      o.capacity_fraction = options.capacities[c];
      o.record_request_hits = policy == "lru" || policy == "opt";
      absl::StatusOr<ReplayResult> r = Replay(trace, o);
      if (!r.ok()) return r.status();
      if (policy == "lru") lru_hits[c] = std::move(r->request_hit_pages);
      if (policy == "opt") opt_hits[c] = std::move(r->request_hit_pages);
      rates[c][k] = 100 * r->TokenHitRate();
    }
  }

  const auto& dims = Dimensions();
  std::array<std::vector<Tally>, kDims> tally;
  for (size_t d = 0; d < kDims; ++d) {
    tally[d].resize(dims[d].buckets.size());
    for (Tally& t : tally[d]) t.lru = t.opt = t.gap = std::vector<int64_t>(caps, 0);
  }
  std::vector<int64_t> gap_total(caps, 0);

  absl::flat_hash_map<PageHash, PageState> pages;
  absl::flat_hash_set<std::pair<PageHash, PageHash>, PairHash> followed;
  // Whether some later request extends request i's whole prompt (its tail is reused), and
  // what the "conversation" policy classes request i's new leaf by: its turn depth and the
  // pages it adds.
  std::vector<bool> extended(trace.requests.size(), false);
  std::vector<uint32_t> turn(trace.requests.size(), 0);
  std::vector<uint32_t> added(trace.requests.size(), 0);
  uint64_t prompt_pages = 0, new_pages = 0;
  for (size_t i = 0; i < trace.requests.size(); ++i) {
    const TraceRequest& r = trace.requests[i];
    // The longest prefix used before and its last user: this request is that user's next
    // turn when the prefix covers the user's whole prompt.
    size_t seen = 0;
    while (seen < r.pages.size() && pages.contains(r.pages[seen])) ++seen;
    std::optional<uint32_t> parent;
    if (seen > 0) {
      const uint32_t p = pages.at(r.pages[seen - 1]).last_request;
      if (seen >= trace.requests[p].pages.size()) {
        parent = p;
        extended[p] = true;
        turn[i] = turn[p] + 1;
      }
    }
    added[i] = static_cast<uint32_t>(r.pages.size() - seen);
    for (size_t pos = 0; pos < r.pages.size(); ++pos) {
      ++prompt_pages;
      std::array<size_t, kDims> bucket{};
      const bool used = pos < seen;
      if (used) {
        const PageState& s = pages.at(r.pages[pos]);
        bucket[kDepth] = Log2Bucket(pos + 1, 6);
        bucket[kReuse] = UsesBucket(s.uses);
        bucket[kGap] = GapBucket((r.arrival_ms - s.last_ms) / 1000);
        bucket[kPopularity] = FanoutBucket(s.fanout);
        bucket[kKind] = parent.has_value() && s.last_request == *parent ? 0 : 1;
        for (size_t d = 0; d < kDims; ++d) {
          Tally& t = tally[d][bucket[d]];
          ++t.pages;
          for (size_t c = 0; c < caps; ++c) {
            const bool lru = pos < lru_hits[c][i], opt = pos < opt_hits[c][i];
            t.lru[c] += lru;
            t.opt[c] += opt;
            t.gap[c] += static_cast<int>(opt) - static_cast<int>(lru);
          }
        }
        for (size_t c = 0; c < caps; ++c) {
          gap_total[c] +=
              static_cast<int>(pos < opt_hits[c][i]) - static_cast<int>(pos < lru_hits[c][i]);
        }
      } else {
        ++new_pages;
      }
    }
    for (size_t pos = 0; pos < r.pages.size(); ++pos) {
      PageState& s = pages[r.pages[pos]];
      ++s.uses;
      s.last_request = static_cast<uint32_t>(i);
      s.last_ms = r.arrival_ms;
      if (pos + 1 < r.pages.size() && followed.insert({r.pages[pos], r.pages[pos + 1]}).second) {
        ++s.fanout;
      }
    }
  }
  const double auc = ClassAuc(extended, turn, added);
  uint64_t used_once = 0;
  for (const auto& [page, s] : pages) used_once += s.uses == 1;
  const uint64_t extended_count = std::count(extended.begin(), extended.end(), true);

  std::printf("\n# Why opt beats lru on %s (%zu requests, one GPU)\n\n", trace.name.c_str(),
              trace.requests.size());
  std::printf(
      "Token hit rates (%%; opt-whether knows whether a page is used again, not when):\n\n");
  std::printf("| capacity | %s |\n|---|%s\n", absl::StrJoin(kPolicies, " | ").c_str(),
              absl::StrJoin(std::vector<std::string>(std::size(kPolicies), "---|"), "").c_str());
  for (size_t c = 0; c < caps; ++c) {
    std::vector<std::string> cells;
    for (double v : rates[c]) cells.push_back(absl::StrFormat("%.2f", v));
    std::printf("| %g %% | %s |\n", 100 * options.capacities[c],
                absl::StrJoin(cells, " | ").c_str());
  }
  std::printf(
      "\nOne-time tails: %.1f %% of distinct pages are used by one request only; %.1f %% of "
      "prompt pages are new when asked for; %.1f %% of requests are extended by a later "
      "prompt (their next turn), %.1f %% never are.\n",
      100.0 * used_once / pages.size(), 100.0 * new_pages / prompt_pages,
      100.0 * extended_count / trace.requests.size(),
      100.0 - 100.0 * extended_count / trace.requests.size());
  std::printf(
      "\nHow well the conversation policy's classes (turn depth 0-4+ x pages added, powers of "
      "two) tell a request that will be continued from one that will not, with each class's "
      "rate taken from this very trace (in-sample, so an upper bound for an online learner): "
      "ROC AUC %.3f (0.5 is chance, 1 is opt-whether's knowledge).\n",
      auc);
  std::printf(
      "\nCells: hits of the class's pages under lru -> opt (%% of the class's pages), and the "
      "class's share of the whole lru->opt gap in pages.\n");
  for (size_t d = 0; d < kDims; ++d) {
    std::printf("\n## By %s\n\n| class | pages seen before |", dims[d].name);
    for (size_t c = 0; c < caps; ++c) std::printf(" %g %% |", 100 * options.capacities[c]);
    std::printf("\n|---|---|%s\n",
                absl::StrJoin(std::vector<std::string>(caps, "---|"), "").c_str());
    for (size_t b = 0; b < dims[d].buckets.size(); ++b) {
      const Tally& t = tally[d][b];
      std::printf("| %s | %llu |", dims[d].buckets[b].c_str(),
                  static_cast<unsigned long long>(t.pages));
      for (size_t c = 0; c < caps; ++c) {
        const double n = t.pages > 0 ? t.pages : 1;
        std::printf(" %.1f -> %.1f (%.1f %%) |", 100 * t.lru[c] / n, 100 * t.opt[c] / n,
                    gap_total[c] != 0 ? 100.0 * t.gap[c] / gap_total[c] : 0.0);
      }
      std::printf("\n");
    }
  }
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace kvcm::bench
