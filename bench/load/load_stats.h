// What kvcm-load measures: the RPC mix it draws from, and per RPC kind a latency histogram
// and the count of each gRPC status code; the text and JSON reports of them.
#ifndef KVCM_BENCH_LOAD_LOAD_STATS_H_
#define KVCM_BENCH_LOAD_LOAD_STATS_H_

#include <array>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bench/load/latency_histogram.h"

namespace kvcm::load {

// kProbe: a Match with probe set (no recency update, no pin, no counters), as routers send.
enum class RpcKind : int { kMatch = 0, kInsert = 1, kRelease = 2, kRoute = 3, kProbe = 4 };
inline constexpr int kNumRpcKinds = 5;
const char* RpcKindName(RpcKind kind);

// Relative weights of the RPC kinds, from "match:70,insert:20,route:10". Immutable.
class RpcMix {
 public:
  static absl::StatusOr<RpcMix> Parse(absl::string_view spec);
  uint32_t weight(RpcKind kind) const { return weights_[static_cast<int>(kind)]; }
  RpcKind Draw(std::mt19937_64& rng) const;
  std::string ToString() const;

 private:
  std::array<uint32_t, kNumRpcKinds> weights_{};
  uint32_t total_ = 0;
};

inline constexpr int kNumGrpcCodes = 17;  // grpc::StatusCode 0 (OK) .. 16

struct KindStats {
  LatencyHistogram latency;  // every completed call, failed ones included
  std::array<uint64_t, kNumGrpcCodes> codes{};
  // Pages of the successful calls' prompts, and of those the manager already had: matched
  // (Match, Route) or already present (Insert).
  uint64_t pages = 0;
  uint64_t hit_pages = 0;

  uint64_t calls() const { return latency.count(); }
  uint64_t errors() const { return calls() - codes[0]; }
  void Merge(const KindStats& other);
};

struct RunStats {
  std::array<KindStats, kNumRpcKinds> kinds;
  // Open loop: arrivals due before the end that were never sent (the outstanding limit
  // held them back).
  uint64_t unsent = 0;

  void Merge(const RunStats& other);
  void Clear() { *this = RunStats(); }
  uint64_t calls() const;
  uint64_t errors() const;
};

// One worker's stats: what it records, the reporter reads. Thread-safe.
class WorkerStats {
 public:
  // `measured`: the call counts in the run's totals (it was due after the warm-up).
  void Record(RpcKind kind, int grpc_code, int64_t latency_ns, bool measured);
  // After a successful call: its prompt's pages and how many of them hit (see KindStats).
  void RecordPages(RpcKind kind, uint64_t pages, uint64_t hit_pages, bool measured);
  void AddUnsent(uint64_t n);
  // Adds the calls recorded since the last TakeInterval to `out`, and forgets them.
  void TakeInterval(RunStats* out);
  void AddTotal(RunStats* out);

 private:
  std::mutex mu_;
  RunStats interval_;
  RunStats total_;
};

// "name": latency percentiles in µs, calls/s over `seconds`, errors by code name.
std::string FormatStatsTable(const RunStats& stats, double seconds);
// One line: calls/s and p50/p99 per kind that had calls, errors.
std::string FormatIntervalLine(const RunStats& stats, double seconds);
// A JSON object with the same figures (latencies in µs).
std::string StatsToJson(const RunStats& stats, double seconds);
const char* GrpcCodeName(int code);

}  // namespace kvcm::load

#endif  // KVCM_BENCH_LOAD_LOAD_STATS_H_
