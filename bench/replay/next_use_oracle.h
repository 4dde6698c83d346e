// TraceNextUseOracle: the future of a trace, for the clairvoyant "opt" policy.
//
// For every page hash of the trace it stores the sorted indices of the requests whose
// prompt holds it (a CSR layout: one offsets array, one indices array, one hash map from page
// to its slice). NextUse(page) is the first of those indices after the cursor, the index of
// the request being served, found by binary search.
//
// The replay moves the cursor forward as it serves requests. Not thread-safe; CacheIndex
// calls NextUse under its own lock, and the replay sets the cursor between calls.
#ifndef KVCM_BENCH_REPLAY_NEXT_USE_ORACLE_H_
#define KVCM_BENCH_REPLAY_NEXT_USE_ORACLE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "bench/replay/trace.h"
#include "server/core/eviction_policy.h"

namespace kvcm::bench {

class TraceNextUseOracle final : public NextUseOracle {
 public:
  // Indexes every request of `trace`, or with `routes` (one GPU per request) only those
  // routed to `gpu`. Request indices stay those of the whole trace. The trace is not kept.
  explicit TraceNextUseOracle(const Trace& trace, std::span<const uint32_t> routes = {},
                              uint32_t gpu = 0);

  // The request now being served (an index into trace.requests).
  void set_cursor(uint64_t request_index) { cursor_ = request_index; }
  uint64_t cursor() const { return cursor_; }

  // Index of the first request after the cursor whose prompt holds `page`; UINT64_MAX when
  // none does (or the page is not in the trace).
  uint64_t NextUse(const PageHash& page) const override;

 private:
  absl::flat_hash_map<PageHash, uint32_t> slot_;  // page -> slice number
  std::vector<uint32_t> offsets_;                 // slice s is [offsets_[s], offsets_[s + 1])
  std::vector<uint32_t> uses_;                    // request indices, ascending in each slice
  uint64_t cursor_ = 0;
};

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_NEXT_USE_ORACLE_H_
