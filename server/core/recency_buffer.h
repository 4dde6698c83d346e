// RecencyBuffer: the recency updates of matches that share the index's lock, held until
// the next exclusive section applies them, in order (docs/PERFORMANCE.md, "Readers beside
// inserts"). It also hands out the access stamps, so that the buffer is in stamp order.
//
// Thread-safe: every method may be called concurrently. The owner takes the accesses out
// (Take) in its exclusive section, when no one records, so that every node an access names
// is still in the tree.
#ifndef KVCM_SERVER_CORE_RECENCY_BUFFER_H_
#define KVCM_SERVER_CORE_RECENCY_BUFFER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/radix_tree.h"

namespace kvcm {

class RecencyBuffer {
 public:
  // A counting match's effect on the eviction order: the path from the root to `node`
  // (null: nothing matched), cut after the prompt's first `end_page` pages, was matched
  // with `stamp` at `at`.
  struct Entry {
    RadixNode* node;
    uint32_t end_page;
    uint64_t stamp;
    absl::Time at;
  };
  // Accesses buffered beyond this make the reader that recorded the last one apply them all
  // (taking the owner's lock exclusively), so a read-only load keeps the buffer small.
  static constexpr size_t kMaxPending = 256;

  // The next access stamp (1, 2, ...), for an access applied at once.
  uint64_t NextStamp() { return clock_.fetch_add(1, std::memory_order_relaxed) + 1; }
  // Stamps and records an access to be applied later; returns the number now pending.
  size_t Record(RadixNode* node, uint32_t end_page, absl::Time at) ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the pending accesses, in the order recorded (stamp order), into `out` (cleared
  // first) and empties the buffer. The two swap storage, so in steady state neither
  // allocates.
  void Take(std::vector<Entry>& out) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Logical time of the last access; a stamp taken under mu_ by Record keeps pending_ in
  // stamp order.
  std::atomic<uint64_t> clock_{0};
  absl::Mutex mu_;
  std::vector<Entry> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_RECENCY_BUFFER_H_
