// Internals of CacheIndex shared by its .cc files (cache_index.cc: namespaces, matching,
// inserting, pins; cache_index_eviction.cc: budgets, eviction, demotion;
// cache_index_expiry.cc: retention; cache_index_quota.cc: tenant quotas and reservations, over
// TenantLedger). Not a public API.
#ifndef KVCM_SERVER_CORE_CACHE_INDEX_INTERNAL_H_
#define KVCM_SERVER_CORE_CACHE_INDEX_INTERNAL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "server/core/cache_index.h"
#include "server/core/retention_queue.h"

namespace kvcm {

struct CacheIndex::Namespace {
  Namespace(NamespaceId id_in, const ModelSpec& spec_in, HashKey key_in, uint64_t page_bytes)
      : id(std::move(id_in)), spec(spec_in), key(key_in), bytes_per_page(page_bytes), tree(this) {
    tree.set_page_cost(page_bytes, spec_in.page_size_tokens);
  }

  const NamespaceId id;
  // Fixed but for kv_layout, which may change once, from empty to the first layout
  // RegisterModel states (under the exclusive lock).
  ModelSpec spec;
  const HashKey key;
  const uint64_t bytes_per_page;
  RadixTree tree;
  // Its tenant's record (owned by CacheIndex::ledger_, which keeps it while this exists).
  Tenant* tenant = nullptr;

  // Retention: the limit RegisterModel (or an inventory) gave (0: the manager's default);
  // the one in force, with every replica of the tree by commit time while there is one.
  absl::Duration registered_max_age = absl::ZeroDuration();
  RetentionQueue retention;
  uint64_t expired_pages = 0;
  // Non-probe matches of this namespace, in whole-page tokens (the per-namespace hit ratio).
  // Added to by matches that share CacheIndex::mu_.
  std::atomic<uint64_t> requested_tokens{0};
  std::atomic<uint64_t> matched_tokens{0};
};

class ABSL_SCOPED_LOCKABLE CacheIndex::WriterLock {
 public:
  explicit WriterLock(CacheIndex* index) ABSL_EXCLUSIVE_LOCK_FUNCTION(index->mu_) : index_(index) {
    index_->mu_.Lock();
    index_->ApplyAccessesLocked();
  }
  ~WriterLock() ABSL_UNLOCK_FUNCTION() { index_->mu_.Unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  CacheIndex* const index_;
};

inline CacheIndex::Namespace* OwnerOf(const RadixNode* node) {
  return static_cast<CacheIndex::Namespace*>(node->tree->owner());
}

inline uint64_t NodeBytes(const RadixNode* node) {
  return uint64_t{node->size()} * OwnerOf(node)->bytes_per_page;
}

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_CACHE_INDEX_INTERNAL_H_
