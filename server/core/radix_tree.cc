#include "server/core/radix_tree.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvcm {

Replica* RadixNode::FindReplica(PoolId pool) {
  for (Replica& r : replicas) {
    if (r.pool == pool) return &r;
  }
  return nullptr;
}

const Replica* RadixNode::FindReplica(PoolId pool) const {
  return const_cast<RadixNode*>(this)->FindReplica(pool);
}

void ChildMap::Insert(const PageHash& first, std::unique_ptr<RadixNode> child) {
  if (large_ == nullptr && small_size_ < kInline) {
    small_[small_size_++] = {first, std::move(child)};
    return;
  }
  if (large_ == nullptr) {
    large_ = std::make_unique<absl::flat_hash_map<PageHash, std::unique_ptr<RadixNode>>>();
    for (uint32_t i = 0; i < small_size_; ++i) {
      large_->emplace(small_[i].first, std::move(small_[i].second));
    }
    small_size_ = 0;
  }
  large_->emplace(first, std::move(child));
}

std::unique_ptr<RadixNode> ChildMap::Extract(const PageHash& first) {
  if (large_ != nullptr) {
    auto node = large_->extract(first);
    assert(!node.empty());
    // The map stays once created: a node that had many children tends to get more.
    return std::move(node.mapped());
  }
  for (uint32_t i = 0; i < small_size_; ++i) {
    if (small_[i].first != first) continue;
    std::unique_ptr<RadixNode> out = std::move(small_[i].second);
    if (i != --small_size_) small_[i] = std::move(small_[small_size_]);
    return out;
  }
  assert(false && "ChildMap::Extract: no such child");
  return nullptr;
}

RadixTree::RadixTree(void* owner) : owner_(owner) { root_.tree = this; }

namespace {

// Starts loading what a match reads of `node` once the path is known: its replicas' block
// ids (the first and last cache line of each). Issued while the walk still climbs, these
// misses overlap the climb's chain of dependent parent loads instead of following it.
void PrefetchBlockIds(const RadixNode* node) {
  for (const Replica& r : node->replicas) {
    if (r.block_ids.empty()) continue;
    __builtin_prefetch(&r.block_ids.front());
    __builtin_prefetch(&r.block_ids.back());
  }
}

}  // namespace

uint32_t RadixTree::Walk(std::span<const PageHash> pages, std::vector<PathStep>* path) {
  path->clear();
  if (pages.empty()) return 0;
  if (const EndTable::Entry* e = ends_.Find(pages.back()); e != nullptr) {
    // Climb from the node that ends the prompt; steps come out last first.
    RadixNode* end = e->node;
    __builtin_prefetch(e->parent);
    size_t pos = pages.size();
    for (RadixNode* n = end; !n->is_root(); n = n->parent) {
      __builtin_prefetch(n->grandparent);
      if (n->size() > pos || n->last_page != pages[pos - 1]) {
        pos = SIZE_MAX;  // not this prompt's path (a broken chain): walk it instead
        break;
      }
      pos -= n->size();
      PrefetchBlockIds(n);
      path->push_back(PathStep{n, static_cast<uint32_t>(pos), n->size()});
    }
    if (pos == 0) {
      std::reverse(path->begin(), path->end());
      return static_cast<uint32_t>(pages.size());
    }
    path->clear();
  }
  RadixNode* node = &root_;
  uint32_t pos = 0;
  while (pos < pages.size()) {
    RadixNode* child = node->children.Find(pages[pos]);
    if (child == nullptr) break;
    // The first page matched through the map lookup. Hashes are chained, so page j of the
    // run equals the prompt's iff every page before it does: checking the last overlapping
    // page settles a full overlap, and a binary search finds where a partial one ends. This
    // reads two or three cache lines of a cold node instead of all its pages.
    const uint32_t limit = std::min<uint32_t>(child->size(), pages.size() - pos);
    uint32_t k = limit;
    const PageHash& last = limit == child->size() ? child->last_page : child->pages[limit - 1];
    if (last != pages[pos + limit - 1]) {
      uint32_t lo = 1, hi = limit - 1;  // pages[0, lo) match; pages[hi] does not
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (child->pages[mid] == pages[pos + mid]) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      k = lo;
    }
    path->push_back(PathStep{child, pos, k});
    pos += k;
    if (k < child->size()) break;
    node = child;
  }
  return pos;
}

RadixNode* RadixTree::Split(RadixNode* node, uint32_t k) {
  assert(!node->is_root() && k > 0 && k < node->size());
  RadixNode* parent = node->parent;
  std::unique_ptr<RadixNode> owned = parent->children.Extract(node->pages[0]);

  auto head = std::make_unique<RadixNode>();
  head->tree = this;
  head->parent = parent;
  head->grandparent = parent->parent;
  head->pages.assign(node->pages.begin(), node->pages.begin() + k);
  head->last_page = head->pages.back();
  ends_.Set(head->last_page, head.get(), parent);
  head->last_access = node->last_access;
  head->last_access_s = node->last_access_s;
  head->hits = node->hits;
  head->priority = node->priority;
  head->score_epoch = node->score_epoch;
  head->pin_count = node->pin_count;
  head->turn = node->turn;
  head->policy_class = node->policy_class;
  head->replicas.reserve(node->replicas.size());
  for (Replica& r : node->replicas) {
    Replica h;
    h.pool = r.pool;
    h.child_refs = 1;
    h.committed_ms = r.committed_ms;
    h.block_ids.assign(r.block_ids.begin(), r.block_ids.begin() + k);
    r.block_ids.erase(r.block_ids.begin(), r.block_ids.begin() + k);
    head->replicas.push_back(std::move(h));
  }
  node->pages.erase(node->pages.begin(), node->pages.begin() + k);
  node->parent = head.get();
  ends_.SetParentIf(node->last_page, node, head.get());
  node->grandparent = parent;
  node->children.ForEach([&](RadixNode* child) { child->grandparent = head.get(); });

  RadixNode* head_ptr = head.get();
  head->children.Insert(node->pages[0], std::move(owned));
  parent->children.Insert(head_ptr->pages[0], std::move(head));
  ++nodes_;
  return head_ptr;
}

RadixNode* RadixTree::AddChild(RadixNode* parent, std::span<const PageHash> pages) {
  assert(!pages.empty());
  auto child = std::make_unique<RadixNode>();
  child->tree = this;
  child->parent = parent;
  child->grandparent = parent->parent;
  child->pages.assign(pages.begin(), pages.end());
  child->last_page = pages.back();
  ends_.Set(child->last_page, child.get(), parent);
  RadixNode* ptr = child.get();
  parent->children.Insert(pages[0], std::move(child));
  ++nodes_;
  pages_ += pages.size();
  return ptr;
}

void RadixTree::Remove(RadixNode* node) {
  assert(!node->is_root() && node->children.empty() && node->replicas.empty() &&
         node->pin_count == 0);
  pages_ -= node->size();
  --nodes_;
  ends_.EraseIf(node->last_page, node);
  node->parent->children.Extract(node->pages[0]);  // destroys it
}

bool RadixTree::LinksConsistent() const {
  std::vector<const RadixNode*> stack = {&root_};
  while (!stack.empty()) {
    const RadixNode* n = stack.back();
    stack.pop_back();
    if (n->grandparent != (n->is_root() ? nullptr : n->parent->parent)) return false;
    // A node may lack its entry only where a broken chain gave two nodes one last page.
    if (const EndTable::Entry* e = n->is_root() ? nullptr : ends_.Find(n->last_page);
        e != nullptr && e->node == n && e->parent != n->parent) {
      return false;
    }
    n->children.ForEach([&](RadixNode* child) { stack.push_back(child); });
  }
  return true;
}

}  // namespace kvcm
