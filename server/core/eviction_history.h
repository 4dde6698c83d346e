// EvictionHistory: the runs of pages the index removed within the last `window` ("ghosts"),
// by their first page's hash (keyed per namespace, so never ambiguous). A run asked for again
// within the window is eviction regret; a re-inserted run starts from its earlier hit count,
// so reuse that outlives a stay in the cache is still seen. One of CacheIndex's seams.
//
// A btree, not a hash map, so that growing it never rehashes millions of entries under the
// index's lock. Not thread-safe: CacheIndex guards it with its lock; Run::regretted is the
// one field written by readers (matches sharing the index's lock mark it under a lock of
// their own), hence mutable.
#ifndef KVCM_SERVER_CORE_EVICTION_HISTORY_H_
#define KVCM_SERVER_CORE_EVICTION_HISTORY_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <utility>

#include "absl/container/btree_map.h"
#include "absl/time/time.h"
#include "common/page_hash.h"

namespace kvcm {

class EvictionHistory {
 public:
  struct Run {
    absl::Time at;  // when it was removed
    uint32_t pages = 0;
    // The node's hit count when it went, and the clock time of its last access.
    uint32_t hits = 0;
    double last_access_s = 0;
    uint64_t policy_tag = 0;  // EvictionPolicy::OnGhostAdded's answer
    // Its regret was counted already (see the class comment).
    mutable bool regretted = false;
  };

  // Zero `window`: nothing is recorded.
  explicit EvictionHistory(absl::Duration window) : window_(window) {}

  bool enabled() const { return window_ > absl::ZeroDuration(); }
  bool empty() const { return runs_.empty(); }
  size_t size() const { return runs_.size(); }

  // Records `run` (removed at run.at) under its first page; a later run of the same first
  // page replaces an earlier one. No-op when disabled.
  void Record(const PageHash& first, Run run);
  // Removes and returns the run starting at `first` (a re-insert), whatever its age.
  std::optional<Run> Take(const PageHash& first);
  // The run starting at `first` removed within the window before `now`, or null.
  const Run* FindRecent(const PageHash& first, absl::Time now) const;
  // Forgets the runs removed more than the window before `now`.
  void Forget(absl::Time now);

 private:
  const absl::Duration window_;
  absl::btree_map<PageHash, Run> runs_;
  // (removal time, first page), oldest first: what Forget walks.
  std::deque<std::pair<absl::Time, PageHash>> order_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_EVICTION_HISTORY_H_
