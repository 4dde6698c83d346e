// RetentionQueue: one namespace's retention limit (max page age) and its replicas ordered
// by commit time, oldest first, so that a sweep finds those past the limit without looking
// at the rest, and goes on where its last bounded step stopped. See docs/EVICTION.md
// ("Retention").
//
// Not thread-safe: guarded by its owner's lock (CacheIndex::mu_).
#ifndef KVCM_SERVER_CORE_RETENTION_QUEUE_H_
#define KVCM_SERVER_CORE_RETENTION_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>

#include "absl/container/btree_set.h"
#include "absl/time/time.h"
#include "common/types.h"
#include "server/core/radix_tree.h"

namespace kvcm {

class RetentionQueue {
 public:
  // One replica: (node, pool) committed at committed_ms (Unix ms). The node pointer is only
  // a key (and the way to the replica while it is queued): the owner removes an entry when
  // its replica leaves the tree, so it never outlives its node.
  struct Entry {
    int64_t committed_ms = 0;
    RadixNode* node = nullptr;
    PoolId pool = 0;

    friend bool operator<(const Entry& a, const Entry& b) {
      if (a.committed_ms != b.committed_ms) return a.committed_ms < b.committed_ms;
      if (a.node != b.node) return std::less<const RadixNode*>()(a.node, b.node);
      return a.pool < b.pool;
    }
    friend bool operator==(const Entry&, const Entry&) = default;
  };

  // The limit in force; InfiniteDuration (the default) when none.
  absl::Duration max_age() const { return max_age_; }
  bool limited() const { return max_age_ != absl::InfiniteDuration(); }
  // Sets the limit in force. True when the queue had none and now has one: the owner then
  // Adds every replica the namespace already holds.
  bool SetMaxAge(absl::Duration limit);
  // Commit times at or before this (Unix ms) are past the limit at `now` (age >= limit);
  // INT64_MIN when there is none.
  int64_t CutoffMs(absl::Time now) const;

  // Queues / unqueues a replica; nothing while there is no limit.
  void Add(const Entry& entry);
  void Remove(const Entry& entry);
  size_t size() const { return entries_.size(); }

  // A sweep's pass, oldest first: the first entry past `cutoff_ms` from where the last
  // step stopped (Pause), and the one after `entry` (which may have left the queue since).
  // Nullopt when there is none past the cutoff.
  std::optional<Entry> First(int64_t cutoff_ms) const;
  std::optional<Entry> Next(const Entry& entry, int64_t cutoff_ms) const;
  // The next First starts at `entry` (a key, not an iterator: the queue changes between
  // steps).
  void Pause(const Entry& entry) { resume_ = entry; }
  // The pass is over: the next First starts at the oldest.
  void EndPass() { resume_.reset(); }

 private:
  std::optional<Entry> PastCutoff(absl::btree_set<Entry>::const_iterator it,
                                  int64_t cutoff_ms) const;

  absl::Duration max_age_ = absl::InfiniteDuration();
  // Kept only while there is a limit.
  absl::btree_set<Entry> entries_;
  std::optional<Entry> resume_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_RETENTION_QUEUE_H_
