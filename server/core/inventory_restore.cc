#include "server/core/inventory_restore.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

// Whether a page's parent chain reaches a first page (zero parent) within the pool.
enum class Chain : uint8_t { kUnknown, kVisiting, kRooted, kOrphan };

struct Node {
  BlockId block;
  PageHash parent;
  Chain chain = Chain::kUnknown;
  bool has_child = false;
  enum : uint8_t { kNotYet, kIndexed, kSuperseded } outcome = kNotYet;
};

}  // namespace

absl::StatusOr<RestoreResult> RestoreInventory(CacheIndex& index, const PoolKey& pool,
                                               uint64_t bytes_per_block,
                                               const InventoryBatch& batch) {
  // Validate everything before changing anything.
  {
    absl::flat_hash_set<BlockId> seen;
    seen.reserve(batch.pages.size());
    for (size_t i = 0; i < batch.pages.size(); ++i) {
      const BlockId b = batch.pages[i].block;
      if (b == kPendingBlock) {
        return absl::InvalidArgumentError(
            absl::StrCat("pages[", i, "].block_id: ", kPendingBlock, " is reserved (pending)"));
      }
      if (!seen.insert(b).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("pages[", i, "].block_id: block ", b, " is listed twice"));
      }
    }
  }
  if (batch.ns.tenant.empty() || batch.ns.model.empty()) {
    return absl::InvalidArgumentError("namespace.tenant and namespace.model must be set");
  }
  if (absl::Status s = batch.spec.Validate(); !s.ok()) return s;
  if (!index.HasPool(pool)) {
    return absl::NotFoundError(absl::StrCat("pool ", pool.ToString(), " is not registered"));
  }

  RestoreResult result;
  auto refuse_all = [&] {
    result.refused_pages = batch.pages.size();
    for (const InventoryPage& p : batch.pages) result.to_free.push_back(p.block);
    return result;
  };
  if (batch.spec.BytesPerPage() != bytes_per_block) return refuse_all();
  if (!index.RegisterModel(batch.ns, batch.spec).ok()) return refuse_all();  // another spec

  // The pool's pages by hash; a second block of the same page is a duplicate.
  absl::flat_hash_map<PageHash, Node> nodes;
  nodes.reserve(batch.pages.size());
  for (const InventoryPage& p : batch.pages) {
    auto [it, inserted] = nodes.try_emplace(p.page, Node{.block = p.block, .parent = p.parent});
    if (!inserted) {
      ++result.duplicate_pages;
      result.to_free.push_back(p.block);
    }
  }

  // Which chains reach a first page: walk up from each page until a page whose answer is
  // known, a first page, or a missing parent, then label the whole walk. Each page is
  // labelled once; a cycle (which hashes cannot form, but a corrupt inventory could) is an
  // orphan.
  std::vector<Node*> walk;
  for (auto& [hash, node] : nodes) {
    Node* n = &node;
    while (n->chain == Chain::kUnknown) {
      n->chain = Chain::kVisiting;
      walk.push_back(n);
      if (n->parent == PageHash{}) break;
      auto parent = nodes.find(n->parent);
      if (parent == nodes.end()) break;
      n = &parent->second;
    }
    Chain label = Chain::kOrphan;
    const Node* top = walk.empty() ? n : walk.back();
    if (n->chain == Chain::kRooted) {
      label = Chain::kRooted;
    } else if (n->chain == Chain::kVisiting && top->parent == PageHash{}) {
      label = Chain::kRooted;
    }
    for (Node* w : walk) w->chain = label;
    walk.clear();
  }
  for (auto& [hash, node] : nodes) {
    if (node.chain != Chain::kRooted || node.parent == PageHash{}) continue;
    nodes.find(node.parent)->second.has_child = true;
  }

  // Insert every rooted leaf's path, first page first.
  std::vector<PageHash> pages;
  std::vector<BlockId> blocks;
  for (auto& [hash, leaf] : nodes) {
    if (leaf.chain != Chain::kRooted || leaf.has_child) continue;
    pages.clear();
    blocks.clear();
    for (PageHash h = hash; h != PageHash{};) {
      const Node& n = nodes.find(h)->second;
      pages.push_back(h);
      blocks.push_back(n.block);
      h = n.parent;
    }
    std::reverse(pages.begin(), pages.end());
    std::reverse(blocks.begin(), blocks.end());
    absl::StatusOr<InsertResult> inserted = index.Insert(batch.ns, pages, pool, blocks);
    if (!inserted.ok()) continue;  // no room: freed below unless another path took them
    for (size_t i = 0; i < pages.size(); ++i) {
      Node& n = nodes.find(pages[i])->second;
      if (n.outcome != Node::kNotYet) continue;
      // A page the pool already held in another block keeps that block; ours is spare.
      const bool other_block =
          i < inserted->already_present_pages && inserted->existing_block_ids[i] != blocks[i];
      n.outcome = other_block ? Node::kSuperseded : Node::kIndexed;
    }
  }

  for (const auto& [hash, node] : nodes) {
    if (node.outcome == Node::kIndexed) {
      ++result.indexed_pages;
      continue;
    }
    if (node.outcome == Node::kSuperseded) {
      ++result.duplicate_pages;
    } else {
      (node.chain == Chain::kRooted ? result.refused_pages : result.orphan_pages) += 1;
    }
    result.to_free.push_back(node.block);
  }
  return result;
}

}  // namespace kvcm
