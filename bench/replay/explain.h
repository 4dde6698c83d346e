// kvcm-bench --explain: what Belady's `opt` keeps that `lru` drops, on one trace.
//
// Replays the trace under lru and opt at each capacity (one GPU, the real CacheIndex) and
// takes, per request, the pages one of them hit and the other did not: a request whose
// prompt lru hit to page a and opt to page b > a puts pages a..b-1 in the gap (and b..a-1
// count against it when lru hit more). Each such page is classed by what the trace alone
// says about it at that request:
//   depth       its position in the prompt (pages), power-of-two buckets;
//   reuse       how many earlier requests used it;
//   gap         time since its last use: how long a cache had to keep it for this hit;
//   popularity  how many different pages followed it in earlier prompts (a shared system
//               prompt has many, one conversation's context one);
//   kind        whether the request is the next turn of the page's last user (its prompt
//               extends that request's whole prompt) or shares a prefix with it.
// A class's share is its pages in the gap over all pages in the gap. Beside them, the
// one-time tails: the share of prompt pages, and of requests' new pages, never used again.
//
// Not thread-safe; runs on the calling thread.
#ifndef KVCM_BENCH_REPLAY_EXPLAIN_H_
#define KVCM_BENCH_REPLAY_EXPLAIN_H_

#include <vector>

#include "absl/status/status.h"
#include "bench/replay/replayer.h"
#include "bench/replay/trace.h"

namespace kvcm::bench {

struct ExplainOptions {
  std::vector<double> capacities = {0.01, 0.05, 0.2};
  // Replay settings besides policy and capacity (spec included).
  ReplayOptions base;
};

// Replays, classes the gap, and prints the tables (Markdown) on stdout.
absl::Status RunExplain(const Trace& trace, const ExplainOptions& options);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_EXPLAIN_H_
