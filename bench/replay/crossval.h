// kvcm-bench --crossval: an evaluation of eviction policies that cannot overfit.
//
// Workloads come in two parts. "train": the first time half of the Mooncake trace, every
// generator (kGeneratorNames) with seeds 1-2 and its default or first variant shape, and one
// two-model mix. "test": the second time half of the Mooncake trace, every generator with
// seeds 3-4 and other shapes, two other mixes (another Llama), and any extra Mooncake-format
// traces given. The parameters of the learning policies ("adaptive", "density",
// "conversation") are chosen, each from a fixed grid, on the real trace's train half alone
// (fewest cells below lru, then the largest mean share of the lru->opt gap closed):
// generators are reported, never chosen on. Then lru, cost, the learning policies (as
// chosen) and opt run on both parts, and the report gives per cell the share of the
// lru->opt gap each policy closes, flagging cells below lru, with real traces and
// generators summarised apart.
//
// Not thread-safe; runs on the calling thread.
#ifndef KVCM_BENCH_REPLAY_CROSSVAL_H_
#define KVCM_BENCH_REPLAY_CROSSVAL_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/replay/replayer.h"
#include "bench/replay/trace.h"
#include "common/model_spec.h"

namespace kvcm::bench {

struct CrossvalWorkload {
  std::string name;
  bool train = false;
  // A real request trace (not a generator or a mix of them): only these choose parameters
  // (on train) and make the headline summary.
  bool real = false;
  Trace trace;
  // Model of each tenant of the trace (TraceRequest::tenant); the page size is the trace's.
  std::vector<ModelSpec> specs;
};

struct CrossvalOptions {
  std::string mooncake_trace;                  // split into time halves
  std::vector<std::string> extra_test_traces;  // Mooncake format, test part only
  ModelSpec mla;                               // every single-model workload, tenant 0 of mixes
  ModelSpec gqa_train;                         // tenant 1 of the train mix
  ModelSpec gqa_test;                          // tenant 1 of the test mixes
  std::string mla_name, gqa_train_name, gqa_test_name;  // for the workloads' names
  std::vector<double> capacities = {0.01, 0.02, 0.05, 0.1, 0.2};
  // Replay settings besides policy, spec and capacity.
  ReplayOptions base;
  bool smoke = false;       // tiny workloads, a two-point grid
  bool train_only = false;  // skip the test part (for development)
  // If set, the only grid point (so the choice is trivial): for development on train.
  std::optional<AdaptiveParams> only_params;
  std::optional<DensityParams> only_density;            // the same for "density"
  std::optional<ConversationParams> only_conversation;  // the same for "conversation"
  std::optional<SelectParams> only_select;              // the same for "select"
  std::string csv;                                      // if set, every run as CSV
};

// The workloads of both parts, train first.
absl::StatusOr<std::vector<CrossvalWorkload>> BuildCrossvalWorkloads(
    const CrossvalOptions& options);

// Runs the whole evaluation and prints its tables (Markdown) on stdout.
absl::Status RunCrossval(const CrossvalOptions& options);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_CROSSVAL_H_
