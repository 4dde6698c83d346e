#include "server/core/inventory_restore.h"

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/enum_names.h"

namespace kvcm {
namespace {

// Whether a page's parent chain reaches a first page (zero parent) within the pool.
enum class Chain : uint8_t { kUnknown, kVisiting, kRooted, kOrphan };

constexpr uint32_t kNone = 0xFFFFFFFF;

// One distinct page of the batch. Pages refer to their parent by index, so that after one
// hash lookup per page every walk is plain array access.
struct Node {
  const InventoryPage* entry;
  uint32_t parent = kNone;  // index of the parent page; kNone for a first page or a missing one
  Chain chain = Chain::kUnknown;
  int64_t committed_ms = 0;  // clamped to [.., now]; now when the agent gave none
  // Past the max page age itself or below such a page (rooted pages only).
  enum : uint8_t { kAgeUnknown, kYoung, kExpired } age = kAgeUnknown;
  bool has_child = false;
  enum : uint8_t { kNotYet, kIndexed, kSuperseded } outcome = kNotYet;
};

}  // namespace

absl::StatusOr<RestoreResult> RestoreInventory(CacheIndex& index, const PoolKey& pool,
                                               uint64_t bytes_per_block,
                                               const InventoryBatch& batch,
                                               std::optional<uint64_t> pool_generation) {
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
      if (batch.pages[i].committed_unix_ms < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("pages[", i, "].committed_unix_ms: ", batch.pages[i].committed_unix_ms,
                         " is before 1970"));
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
  absl::StatusOr<RegisterModelResult> registered = index.RegisterModel(
      batch.ns, batch.spec, CacheIndex::NamespaceSource::kInventory, batch.max_page_age);
  if (registered.status().code() == absl::StatusCode::kInvalidArgument) {
    return registered.status();  // the max page age
  }
  if (!registered.ok()) return refuse_all();  // another spec or kv_layout

  // The pool's distinct pages; a second block of the same page is a duplicate.
  std::vector<Node> nodes;
  nodes.reserve(batch.pages.size());
  absl::flat_hash_map<PageHash, uint32_t> index_of;
  index_of.reserve(batch.pages.size());
  for (const InventoryPage& p : batch.pages) {
    if (index_of.try_emplace(p.page, static_cast<uint32_t>(nodes.size())).second) {
      nodes.push_back(Node{.entry = &p});
    } else {
      ++result.duplicate_pages;
      result.to_free.push_back(p.block);
    }
  }
  const int64_t now_ms = absl::ToUnixMillis(index.Now());
  for (Node& n : nodes) {
    const int64_t t = n.entry->committed_unix_ms;
    n.committed_ms = t == 0 ? now_ms : std::min(t, now_ms);
    if (n.entry->parent == PageHash{}) continue;
    if (auto it = index_of.find(n.entry->parent); it != index_of.end()) n.parent = it->second;
  }

  // Which chains reach a first page: walk up from each page until a page whose answer is
  // known, a first page, or a missing parent, then label the whole walk. Each page is
  // labelled once; a cycle (which hashes cannot form, but a corrupt inventory could) is an
  // orphan.
  std::vector<uint32_t> walk;
  for (uint32_t start = 0; start < nodes.size(); ++start) {
    uint32_t i = start;
    while (nodes[i].chain == Chain::kUnknown) {
      nodes[i].chain = Chain::kVisiting;
      walk.push_back(i);
      if (nodes[i].parent == kNone) break;
      i = nodes[i].parent;
    }
    Chain label = Chain::kOrphan;
    if (nodes[i].chain == Chain::kRooted) {
      label = Chain::kRooted;
    } else if (!walk.empty() && nodes[walk.back()].parent == kNone &&
               nodes[walk.back()].entry->parent == PageHash{}) {
      label = Chain::kRooted;  // the walk ended at a first page
    }
    for (uint32_t w : walk) nodes[w].chain = label;
    walk.clear();
  }
  // Which rooted pages are past the namespace's max page age, or below one that is: a pool
  // holds whole prefixes, so those leave with it. Labelled as the chains were.
  const absl::Duration limit = registered->max_page_age;
  const int64_t cutoff_ms =
      limit == absl::ZeroDuration() ? INT64_MIN : absl::ToUnixMillis(index.Now() - limit);
  for (uint32_t start = 0; start < nodes.size(); ++start) {
    if (nodes[start].chain != Chain::kRooted) continue;
    uint32_t i = start;
    while (i != kNone && nodes[i].age == Node::kAgeUnknown) {
      walk.push_back(i);
      i = nodes[i].parent;
    }
    bool expired = i != kNone && nodes[i].age == Node::kExpired;
    for (auto w = walk.rbegin(); w != walk.rend(); ++w) {  // from the top down
      expired = expired || nodes[*w].committed_ms <= cutoff_ms;
      nodes[*w].age = expired ? Node::kExpired : Node::kYoung;
    }
    walk.clear();
  }
  for (const Node& n : nodes) {
    if (n.age == Node::kYoung && n.parent != kNone) nodes[n.parent].has_child = true;
  }

  // Insert every young rooted leaf's path, first page first: one insert per run of pages
  // with one commit time (a prompt's pages committed by one insert share it), so that every
  // page gets its own time back.
  std::vector<uint32_t> path;
  std::vector<PageHash> pages;
  std::vector<BlockId> blocks;
  for (uint32_t leaf = 0; leaf < nodes.size(); ++leaf) {
    if (nodes[leaf].age != Node::kYoung || nodes[leaf].has_child) continue;
    path.clear();
    for (uint32_t i = leaf; i != kNone; i = nodes[i].parent) path.push_back(i);
    std::reverse(path.begin(), path.end());
    pages.clear();
    blocks.clear();
    for (uint32_t i : path) {
      pages.push_back(nodes[i].entry->page);
      blocks.push_back(nodes[i].entry->block);
    }
    for (size_t end = 1; end <= path.size(); ++end) {
      if (end < path.size() && nodes[path[end]].committed_ms == nodes[path[end - 1]].committed_ms) {
        continue;  // the run goes on
      }
      // Pages [0, end) now: the runs before are in already, with their own times.
      absl::StatusOr<InsertResult> inserted =
          index.Insert(batch.ns, std::span(pages).first(end), pool, std::span(blocks).first(end),
                       {.pool_generation = pool_generation,
                        .committed_at = absl::FromUnixMillis(nodes[path[end - 1]].committed_ms)});
      if (inserted.status().code() == absl::StatusCode::kAborted) return inserted.status();
      if (!inserted.ok()) break;  // no room: freed below unless another path took them
      for (size_t k = 0; k < end; ++k) {
        Node& n = nodes[path[k]];
        if (n.outcome != Node::kNotYet) continue;
        // A page the pool already held in another block keeps that block; ours is spare.
        const bool other_block =
            k < inserted->already_present_pages && inserted->existing_block_ids[k] != blocks[k];
        n.outcome = other_block ? Node::kSuperseded : Node::kIndexed;
      }
    }
  }

  for (const Node& node : nodes) {
    if (node.outcome == Node::kIndexed) {
      ++result.indexed_pages;
      continue;
    }
    if (node.outcome == Node::kSuperseded) {
      ++result.duplicate_pages;
    } else if (node.age == Node::kExpired) {
      ++result.expired_pages;
    } else {
      (node.chain == Chain::kRooted ? result.refused_pages : result.orphan_pages) += 1;
    }
    result.to_free.push_back(node.entry->block);
  }
  return result;
}

InventoryCollector::InventoryCollector(std::string agent_id, uint64_t bytes_per_block,
                                       std::vector<Pool> pools)
    : agent_id_(std::move(agent_id)),
      bytes_per_block_(bytes_per_block),
      pools_(std::move(pools)),
      batches_(pools_.size()),
      seen_(pools_.size()) {}

absl::Status InventoryCollector::Add(Tier tier, const NamespaceId& ns, const ModelSpec& spec,
                                     std::vector<InventoryPage> pages,
                                     absl::Duration max_page_age) {
  size_t p = 0;
  while (p < pools_.size() && pools_[p].tier != tier) ++p;
  if (p == pools_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier ", TierName(tier), " is not a pool of agent ", agent_id_));
  }
  if (auto it = specs_.find(ns); it != specs_.end() && !(it->second == spec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec: namespace ", ns.ToString(), " came with another spec before"));
  }
  if (max_page_age < absl::ZeroDuration() || max_page_age > absl::Seconds(kMaxPageAgeS)) {
    return absl::InvalidArgumentError(absl::StrCat("max_page_age_s must be in [0, ", kMaxPageAgeS,
                                                   "], got ", absl::ToInt64Seconds(max_page_age)));
  }
  absl::flat_hash_set<BlockId>& seen = seen_[p];
  for (size_t i = 0; i < pages.size(); ++i) {
    const BlockId b = pages[i].block;
    absl::string_view why;
    if (b == kPendingBlock) {
      why = "is reserved (pending)";
    } else if (b >= pools_[p].num_blocks) {
      why = "is past the pool";
    } else if (!seen.insert(b).second) {
      why = "is listed twice";
    } else if (pages[i].committed_unix_ms < 0) {
      seen.erase(b);
      for (size_t j = 0; j < i; ++j) seen.erase(pages[j].block);
      return absl::InvalidArgumentError(absl::StrCat(
          "committed_unix_ms[", i, "]: ", pages[i].committed_unix_ms, " is before 1970"));
    }
    if (!why.empty()) {
      for (size_t j = 0; j < i; ++j) seen.erase(pages[j].block);  // added nothing
      return absl::InvalidArgumentError(
          absl::StrCat("block_ids[", i, "]: block ", b, " of pool ", TierName(tier), " ", why));
    }
  }
  specs_.try_emplace(ns, spec);
  InventoryBatch& batch = batches_[p][ns.ToString()];
  if (batch.pages.empty()) {
    batch.ns = ns;
    batch.spec = spec;
  }
  if (max_page_age > absl::ZeroDuration() &&
      (batch.max_page_age == absl::ZeroDuration() || max_page_age < batch.max_page_age)) {
    batch.max_page_age = max_page_age;  // as RegisterModel would: only tightens
  }
  batch.pages.insert(batch.pages.end(), pages.begin(), pages.end());
  pages_ += pages.size();
  return absl::OkStatus();
}

absl::StatusOr<InventoryOutcome> InventoryCollector::Restore(CacheIndex& index) const {
  InventoryOutcome out;
  for (size_t p = 0; p < pools_.size(); ++p) {
    const PoolKey pool{agent_id_, pools_[p].tier};
    for (const auto& [name, batch] : batches_[p]) {
      absl::StatusOr<RestoreResult> r =
          RestoreInventory(index, pool, bytes_per_block_, batch, pools_[p].generation);
      if (r.status().code() == absl::StatusCode::kAborted) return r.status();
      std::vector<BlockId>& to_free = out.to_free[pools_[p].tier];
      if (!r.ok()) {  // checked by Add, so not expected: the pages cannot be indexed
        out.refused_pages += batch.pages.size();
        for (const InventoryPage& page : batch.pages) to_free.push_back(page.block);
        continue;
      }
      out.indexed_pages += r->indexed_pages;
      out.orphan_pages += r->orphan_pages;
      out.duplicate_pages += r->duplicate_pages;
      out.refused_pages += r->refused_pages;
      out.expired_pages += r->expired_pages;
      to_free.insert(to_free.end(), r->to_free.begin(), r->to_free.end());
    }
  }
  return out;
}

}  // namespace kvcm
