// kvcm-bench output: one row per (workload, policy, capacity, cluster mode) as a readable
// table, CSV and JSON, and a progress bar on stderr for interactive runs.
//
// Not thread-safe.
#ifndef KVCM_BENCH_REPLAY_REPORT_H_
#define KVCM_BENCH_REPLAY_REPORT_H_

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "bench/replay/replayer.h"

namespace kvcm::bench {

struct ResultRow {
  std::string workload;
  std::string policy;
  double capacity_fraction = 0;
  std::string mode;  // "global" or "local"
  uint32_t gpus = 1;
  std::string route;
  std::string backing = "index";  // PoolBackingName: "index" or "agent"
  ReplayResult result;
};

// Fixed-width table, one line per row, with a header.
std::string FormatTable(std::span<const ResultRow> rows);

// For rows run both ways (kvcm-bench --backing=both): one line per cell (workload, policy,
// capacity, mode) that has an "index" and an "agent" row, with both token hit rates and their
// difference in points (agent - index), both evicted pages and failed inserts, and the
// agent's short allocations. The largest difference last.
std::string FormatBackingComparison(std::span<const ResultRow> rows);

// CSV with a header line; one line per row. Column names are those of the JSON fields.
absl::Status WriteCsv(const std::string& path, std::span<const ResultRow> rows);

// {"config": {key: value, ...}, "results": [{...}, ...]}. Config values are written as
// JSON strings.
absl::Status WriteJson(const std::string& path,
                       std::span<const std::pair<std::string, std::string>> config,
                       std::span<const ResultRow> rows);

// "\r[=====     ] 3/40 chat lru 0.05 global  1234/5000" redrawn in place on stderr, only
// when stderr is a terminal; otherwise every call does nothing.
class ProgressBar {
 public:
  explicit ProgressBar(size_t total_runs);
  ~ProgressBar() { Finish(); }
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  bool enabled() const { return enabled_; }
  // Run `run` (0-based) named `label` has served `done` of `total` requests.
  void Update(size_t run, const std::string& label, size_t done, size_t total);
  // Clears the bar's line, so that what is printed next starts on a clean line.
  void Finish();

 private:
  const bool enabled_;
  const size_t total_runs_;
  size_t drawn_width_ = 0;
};

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_REPORT_H_
