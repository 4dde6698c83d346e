// EndTable: RadixTree's index of nodes by their last page, built for one cache miss.
//
// A full-hit match starts with a lookup of the prompt's last page here (radix_tree.h), and
// on a 1M-page index that lookup is a chain of DRAM misses: a swiss table reads its control
// bytes, then its slot. Here the slot itself holds the key, the node and the node's parent
// (32 bytes, two to a cache line), found by linear probing from a seeded mix of the page
// hash, at most half full: one miss in the common case. The seed is drawn per table, so
// page hashes chosen by a client cannot be made to collide on purpose. Deletion shifts
// the entries behind back (no tombstones), so probes stay short under churn.
//
// Not thread-safe: RadixTree's callers serialise access.
#ifndef KVCM_SERVER_CORE_END_TABLE_H_
#define KVCM_SERVER_CORE_END_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/page_hash.h"

namespace kvcm {

struct RadixNode;

class EndTable {
 public:
  // 32 bytes and aligned to them: an entry never straddles two cache lines.
  struct alignas(32) Entry {
    PageHash page;
    RadixNode* node = nullptr;  // null: the slot is free
    RadixNode* parent = nullptr;
  };

  EndTable();
  EndTable(const EndTable&) = delete;
  EndTable& operator=(const EndTable&) = delete;

  // The entry of `page`, or null. The pointer is valid until the next Set or Erase.
  const Entry* Find(const PageHash& page) const {
    for (size_t i = SlotOf(page);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.node == nullptr) return nullptr;
      if (e.page == page) return &e;
    }
  }
  // Adds or replaces the entry of `page`. REQUIRES: node != nullptr.
  void Set(const PageHash& page, RadixNode* node, RadixNode* parent);
  // Sets the parent of `page`'s entry if it names `node`; no-op otherwise.
  void SetParentIf(const PageHash& page, const RadixNode* node, RadixNode* parent);
  // Removes `page`'s entry if it names `node`; no-op otherwise.
  void EraseIf(const PageHash& page, const RadixNode* node);

  size_t size() const { return size_; }
  size_t capacity() const { return mask_ + 1; }

 private:
  size_t SlotOf(const PageHash& page) const {
    // A multiply-xorshift of both words with the table's seed: cheap, and unpredictable to
    // whoever chose the hash (keys that share a word still spread).
    uint64_t x = (page.lo ^ seed_) * 0x9E3779B97F4A7C15ULL;
    x ^= page.hi * 0xC2B2AE3D27D4EB4FULL;
    x ^= x >> 29;
    return static_cast<size_t>(x) & mask_;
  }
  Entry* FindMutable(const PageHash& page) { return const_cast<Entry*>(Find(page)); }
  void Grow();

  std::unique_ptr<Entry[]> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
  uint64_t seed_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_END_TABLE_H_
