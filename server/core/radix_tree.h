// RadixTree: the compressed radix tree of one namespace's page hashes.
//
// A node stands for a run of consecutive pages with no branching inside, all held by the
// same set of pools (a Replica per pool, with one block id per page). Pages of one pool are
// prefix-closed: a pool holding page i of a prompt holds pages 0..i-1 too, because Insert
// always names a prompt from its first page. So "leaf in pool p" means: the node has a
// replica in p and no child does, which Replica::child_refs counts in O(1).
//
// The tree only keeps structure; CacheIndex decides when to split, add and remove, and
// keeps the budget, the policy and the pins in step. Not thread-safe.
#ifndef KVCM_SERVER_CORE_RADIX_TREE_H_
#define KVCM_SERVER_CORE_RADIX_TREE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "server/core/end_table.h"

namespace kvcm {

class RadixTree;

struct Replica {
  PoolId pool = 0;
  // Children of the node that also have a replica in `pool`.
  uint32_t child_refs = 0;
  // Whether the policy currently tracks this replica as an eviction candidate.
  bool evictable = false;
  // When the pool's blocks were committed to these pages, in Unix milliseconds (their age,
  // for retention, counts from it).
  int64_t committed_ms = 0;
  std::vector<BlockId> block_ids;  // one per page of the node
};

struct RadixNode;

// The children of a node, by first page. Most nodes have one or two children (a run that
// branched once); those live inline in the node, so a walk reaches the child without
// touching a hash table. A node with more children (the root, a shared system prompt)
// moves them all into a hash map. Owns the children.
class ChildMap {
 public:
  ChildMap() = default;
  ChildMap(const ChildMap&) = delete;
  ChildMap& operator=(const ChildMap&) = delete;

  RadixNode* Find(const PageHash& first) const {
    if (large_ != nullptr) {
      auto it = large_->find(first);
      return it == large_->end() ? nullptr : it->second.get();
    }
    for (uint32_t i = 0; i < small_size_; ++i) {
      if (small_[i].first == first) return small_[i].second.get();
    }
    return nullptr;
  }
  // REQUIRES: no child starts with `first`.
  void Insert(const PageHash& first, std::unique_ptr<RadixNode> child);
  // The child starting with `first`, no longer owned here. REQUIRES: it exists.
  std::unique_ptr<RadixNode> Extract(const PageHash& first);

  bool empty() const { return size() == 0; }
  size_t size() const { return large_ != nullptr ? large_->size() : small_size_; }
  // Calls fn(RadixNode*) for every child, in no particular order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    if (large_ != nullptr) {
      for (const auto& [first, child] : *large_) fn(child.get());
    } else {
      for (uint32_t i = 0; i < small_size_; ++i) fn(small_[i].second.get());
    }
  }

 private:
  static constexpr uint32_t kInline = 2;
  std::array<std::pair<PageHash, std::unique_ptr<RadixNode>>, kInline> small_;
  uint32_t small_size_ = 0;
  std::unique_ptr<absl::flat_hash_map<PageHash, std::unique_ptr<RadixNode>>> large_;
};

struct RadixNode {
  RadixTree* tree = nullptr;
  RadixNode* parent = nullptr;  // null for the root
  // parent->parent (null for the root and its children): lets a climb through the parents
  // start loading two levels up while it reads one, halving its chain of dependent misses.
  RadixNode* grandparent = nullptr;
  std::vector<PageHash> pages;  // empty only for the root
  // pages.back(), kept in the node itself: a walk that covers the whole run checks only
  // this (hashes are chained) and never touches the cold pages array.
  PageHash last_page;
  ChildMap children;  // by first page
  absl::InlinedVector<Replica, 1> replicas;
  // Logical time of the last match or insert that went through the node.
  uint64_t last_access = 0;
  // Clock time of that access, in seconds since the Unix epoch.
  double last_access_s = 0;
  // Matches that went through the node (its first page), for frequency-aware policies.
  uint32_t hits = 0;
  // The policy's sort key (lower is evicted first); only the policy writes it.
  double priority = 0;
  // Live pins on this node or any descendant (pins cover the whole path from the root).
  uint32_t pin_count = 0;
  // State a policy keeps per node (in what would be padding): the "conversation" policy's
  // turn depth and class of the prompt that added the node (EvictionPolicy::OnLeafAdded).
  uint8_t turn = 0;
  uint8_t policy_class = 0;
  // "select": which of its choices (a count of its moves) last wrote `priority`. A node
  // that was no candidate when the choice moved keeps the old choice's score until then.
  uint16_t score_epoch = 0;

  bool is_root() const { return parent == nullptr; }
  uint32_t size() const { return static_cast<uint32_t>(pages.size()); }
  Replica* FindReplica(PoolId pool);
  const Replica* FindReplica(PoolId pool) const;
};

// One step of a walk: `matched` leading pages of `node` equal the prompt's pages starting
// at `first_page`.
struct PathStep {
  RadixNode* node;
  uint32_t first_page;
  uint32_t matched;
};

class RadixTree {
 public:
  // `owner` is opaque context for CacheIndex (its namespace record).
  explicit RadixTree(void* owner);
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  void* owner() const { return owner_; }
  // What one page of this tree costs in a pool; set by CacheIndex, read by policies.
  uint64_t bytes_per_page() const { return bytes_per_page_; }
  uint32_t page_size_tokens() const { return page_size_tokens_; }
  void set_page_cost(uint64_t bytes_per_page, uint32_t page_size_tokens) {
    bytes_per_page_ = bytes_per_page;
    page_size_tokens_ = page_size_tokens;
  }
  // Which group of trees the eviction policy files this tree's candidates under
  // (EvictionPolicy::TrackGroups); CacheIndex gives all trees of one tenant one group.
  uint32_t group() const { return group_; }
  void set_group(uint32_t group) { group_ = group; }
  RadixNode* root() { return &root_; }

  // Longest cached prefix of `pages`: appends the steps of the path to `path` (cleared
  // first) and returns the matched page count. Changes nothing. When a node ends with the
  // prompt's last page, the path is that node's ancestry (checked: every node's last page
  // is the prompt's page at its end, and the runs add up to the prompt).
  // Relies on pages being chained hashes (equal page i implies equal pages 0..i-1); for
  // arbitrary sequences that break the chain, the result is only an upper bound.
  uint32_t Walk(std::span<const PageHash> pages, std::vector<PathStep>* path);

  // Splits `node` so that its first `k` pages become a new parent node, which is returned;
  // `node` keeps the rest, its replicas' child_refs and its identity. The new node copies
  // pin_count, last_access, hits and priority, and gets child_refs = 1 for every replica.
  // REQUIRES: !node->is_root(), 0 < k < node->size().
  RadixNode* Split(RadixNode* node, uint32_t k);

  // Adds a child of `parent` holding `pages` (no replicas yet) and returns it.
  // REQUIRES: pages non-empty, no child of parent starts with pages[0].
  RadixNode* AddChild(RadixNode* parent, std::span<const PageHash> pages);

  // Destroys `node`. REQUIRES: a non-root leaf with no replicas and no pins.
  void Remove(RadixNode* node);

  // Bookkeeping by CacheIndex when it adds or drops replicas.
  void AddPageLocations(int64_t delta) { page_locations_ += delta; }

  // The node whose run ends with `page` (hashes are chained: at most one does), or null.
  RadixNode* NodeEndingWith(const PageHash& page) const {
    const EndTable::Entry* e = ends_.Find(page);
    return e == nullptr ? nullptr : e->node;
  }

  // Whether every node's grandparent and entry by its last page agree with the tree (the
  // climb's hints); for tests, O(nodes).
  bool LinksConsistent() const;

  uint64_t nodes() const { return nodes_; }
  uint64_t pages() const { return pages_; }
  uint64_t page_locations() const { return page_locations_; }

 private:
  void* const owner_;
  uint64_t bytes_per_page_ = 0;
  uint32_t page_size_tokens_ = 0;
  uint32_t group_ = 0;
  RadixNode root_;
  uint64_t nodes_ = 0;  // excluding the root
  uint64_t pages_ = 0;
  uint64_t page_locations_ = 0;
  // Every node by its last page. A prompt that ends where a node ends (a full hit) is
  // matched by one lookup and a climb through the parents, instead of a map lookup per
  // level: the walk is bound by cache misses, about four per level. The entry names the
  // node's parent too, so that the climb loads the node and its parent at once.
  EndTable ends_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_RADIX_TREE_H_
