// CacheIndex: retention. Every replica carries the time its pool committed it; a namespace
// with a max page age keeps its replicas in its RetentionQueue (retention_queue.h) by that
// time, and SweepExpired removes those past the age, oldest first, in bounded steps. See
// cache_index.h and docs/EVICTION.md ("Retention").
#include <algorithm>
#include <cassert>
#include <cstdint>
#include <vector>

#include "server/core/cache_index.h"
#include "server/core/cache_index_internal.h"

namespace kvcm {

absl::Duration CacheIndex::MaxPageAgeFor(absl::Duration registered) const {
  absl::Duration limit = absl::InfiniteDuration();
  for (absl::Duration d : {registered, options_.default_max_page_age}) {
    if (d > absl::ZeroDuration()) limit = std::min(limit, d);
  }
  return limit;
}

void CacheIndex::SetMaxPageAge(Namespace& ns, absl::Duration registered) {
  ns.registered_max_age = registered;
  if (!ns.retention.SetMaxAge(MaxPageAgeFor(registered))) return;
  // The namespace gets a limit: queue every replica it holds (once per namespace; a limit,
  // once set, only tightens), as TrackExpiry would have. Not an engine's: UntrackExpiry
  // leaves those out, so a queued one would outlive its node.
  std::vector<RadixNode*> stack = {ns.tree.root()};
  while (!stack.empty()) {
    RadixNode* node = stack.back();
    stack.pop_back();
    for (const Replica& r : node->replicas) {
      if (!budget_.engine(r.pool)) ns.retention.Add({r.committed_ms, node, r.pool});
    }
    node->children.ForEach([&](RadixNode* child) { stack.push_back(child); });
  }
  expiring_.push_back(&ns);
}

bool CacheIndex::HoldsExpired(const RadixNode* node, int64_t cutoff_ms) const {
  if (cutoff_ms == INT64_MIN) return false;
  for (const Replica& r : node->replicas) {
    if (r.committed_ms <= cutoff_ms && !budget_.retired(r.pool) && !budget_.engine(r.pool)) {
      return true;
    }
  }
  return false;
}

void CacheIndex::TrackExpiry(RadixNode* node, const Replica& replica) {
  // An engine's pages stay as long as the engine keeps them: retention is the engine's.
  if (budget_.engine(replica.pool)) return;
  OwnerOf(node)->retention.Add({replica.committed_ms, node, replica.pool});
}

void CacheIndex::UntrackExpiry(RadixNode* node, const Replica& replica) {
  if (budget_.engine(replica.pool)) return;
  OwnerOf(node)->retention.Remove({replica.committed_ms, node, replica.pool});
}

ExpirySweepResult CacheIndex::SweepExpired(size_t max_steps) {
  WriterLock lock(this);
  ExpirySweepResult result;
  const absl::Time now = clock_->Now();
  // Pins that lapsed release what they held before it is looked at.
  ExpireLeasesLocked(now);
  size_t steps = 0;
  while (expiry_next_ < expiring_.size()) {
    if (!SweepNamespace(*expiring_[expiry_next_], now, max_steps, steps, result)) {
      result.more = true;
      return result;
    }
    ++expiry_next_;
  }
  expiry_next_ = 0;  // the pass is over; the next call starts another
  return result;
}

bool CacheIndex::SweepNamespace(Namespace& ns, absl::Time now, size_t max_steps, size_t& steps,
                                ExpirySweepResult& result) {
  RetentionQueue& queue = ns.retention;
  const int64_t cutoff_ms = queue.CutoffMs(now);
  for (std::optional<RetentionQueue::Entry> entry = queue.First(cutoff_ms); entry.has_value();
       entry = queue.Next(*entry, cutoff_ms)) {
    if (steps >= max_steps) {
      queue.Pause(*entry);
      return false;
    }
    // A dropped pool's replicas leave through SweepRetired; a pinned node's wait for its
    // pins (no new pin can reach it: Match ends before it, RenewLease refuses). Looking at
    // one is a step, as removing one is, so every call makes progress.
    if (budget_.retired(entry->pool) || entry->node->pin_count > 0) {
      ++steps;
      continue;
    }
    if (!ExpireSubtree(entry->node, entry->pool, max_steps, steps, result)) {
      queue.Pause(*entry);  // the rest of this subtree first, next call
      return false;
    }
  }
  queue.EndPass();
  return true;
}

bool CacheIndex::ExpireSubtree(RadixNode* top, PoolId pool, size_t max_steps, size_t& steps,
                               ExpirySweepResult& result) {
  Namespace& ns = *OwnerOf(top);
  // Post-order: a node's replica goes once its children's replicas in the pool have gone.
  std::vector<RadixNode*> stack = {top};
  while (!stack.empty()) {
    RadixNode* node = stack.back();
    const Replica* r = node->FindReplica(pool);
    assert(r != nullptr && node->pin_count == 0);
    if (r->child_refs > 0) {
      node->children.ForEach([&](RadixNode* child) {
        if (child->FindReplica(pool) != nullptr) stack.push_back(child);
      });
      continue;
    }
    if (steps >= max_steps) return false;
    ++steps;
    stack.pop_back();
    const uint32_t pages = node->size();
    // The node may go inside RemoveReplica: copy what the event needs first.
    std::vector<PageHash> removed_pages = node->pages;
    std::vector<BlockId> block_ids = RemoveReplica(node, pool, [](RadixNode*) {});
    counters_.expired_pages += pages;
    ns.expired_pages += pages;
    result.expired_pages += pages;
    ++result.removed_replicas;
    Emit(CacheEvent::Kind::kRemoved, ns, pool, removed_pages, std::move(block_ids),
         CacheEvent::Reason::kExpired);
  }
  return true;
}

}  // namespace kvcm
