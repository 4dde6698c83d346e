// CacheIndex: engine pools, the prefix caches of inference engines that keep their own KV
// (PublishEngineEvents). Each change walks the chain it names from the root, like Insert,
// and applies without eviction, quota or reservation (only the engine page caps bound it):
// the engine decided already.
#include <algorithm>
#include <cassert>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/core/cache_index.h"
#include "server/core/cache_index_internal.h"

namespace kvcm {
namespace {

absl::Status NotAnEnginePool(const PoolKey& pool) {
  return absl::FailedPreconditionError(
      absl::StrCat("pool ", pool.ToString(),
                   " is an agent's (or index-only) pool, not an engine's: an engine id must not "
                   "be an agent id"));
}

}  // namespace

absl::StatusOr<PoolId> CacheIndex::EnginePool(const PoolKey& pool, bool create) {
  std::optional<PoolId> id = budget_.Find(pool);
  if (!id.has_value()) {
    if (!create) return absl::NotFoundError(absl::StrCat("pool ", pool.ToString(), " is unknown"));
    return budget_.Intern(pool, /*capacity_bytes=*/0, /*engine=*/true);
  }
  if (!budget_.engine(*id)) return NotAnEnginePool(pool);
  return *id;
}

absl::Status CacheIndex::CheckEnginePool(const PoolKey& pool) const {
  absl::ReaderMutexLock lock(&mu_);
  std::optional<PoolId> id = budget_.Find(pool);
  if (id.has_value() && !budget_.engine(*id)) return NotAnEnginePool(pool);
  return absl::OkStatus();
}

absl::Status CacheIndex::NotEnginePool(PoolId pool, const PoolKey& key,
                                       absl::string_view what) const {
  if (!budget_.engine(pool)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("pool ", key.ToString(), " is engine ", key.agent_id,
                   "'s pool: only its engine's events change it, it cannot be ", what));
}

uint64_t CacheIndex::RemoveEngineSubtree(RadixNode* top, PoolId pool,
                                         absl::FunctionRef<void(const RadixNode&)> on_node) {
  // Preorder over the nodes holding the pool (prefix closure: no other node has a
  // descendant that does), then removed back to front, every node after its descendants.
  std::vector<RadixNode*> order;
  std::vector<RadixNode*> stack = {top};
  while (!stack.empty()) {
    RadixNode* node = stack.back();
    stack.pop_back();
    order.push_back(node);
    node->children.ForEach([&](RadixNode* child) {
      if (child->FindReplica(pool) != nullptr) stack.push_back(child);
    });
  }
  uint64_t removed = 0;
  for (auto n = order.rbegin(); n != order.rend(); ++n) {
    removed += (*n)->size();
    on_node(**n);
    (void)RemoveReplica(*n, pool, [](RadixNode*) {});  // kNoBlock ids: nothing to free
  }
  return removed;
}

absl::StatusOr<uint64_t> CacheIndex::StoreEnginePages(const NamespaceId& ns_id,
                                                      std::span<const PageHash> pages,
                                                      const PoolKey& pool) {
  if (pages.empty()) return absl::InvalidArgumentError("page_hashes: no page to store");
  if (pool.agent_id.empty()) return absl::InvalidArgumentError("pool.agent_id must be set");
  WriterLock lock(this);
  const absl::Time now = clock_->Now();
  ExpireLeasesLocked(now);
  absl::StatusOr<Namespace*> found = FindNamespace(ns_id);
  if (!found.ok()) return found.status();
  Namespace& ns = **found;
  absl::StatusOr<PoolId> pid = EnginePool(pool, /*create=*/true);
  if (!pid.ok()) return pid.status();

  std::vector<PathStep> path;
  const uint32_t n = static_cast<uint32_t>(pages.size());
  const uint32_t in_tree = ns.tree.Walk(pages, &path);
  uint32_t in_pool = 0;
  for (const PathStep& step : path) {
    if (step.node->FindReplica(*pid) == nullptr) break;
    in_pool += step.matched;
  }
  if (in_pool == n) return 0;
  // The engine's caps, before anything changes: every page past in_pool is a new
  // page-location of this pool.
  const uint64_t adding = n - in_pool;
  if (const uint64_t held = EnginePagesLocked(pool.agent_id);
      held + adding > options_.max_engine_pages_per_engine) {
    return absl::ResourceExhaustedError(
        absl::StrCat("max_engine_pages_per_engine: engine ", pool.agent_id, " holds ", held,
                     " of its ", options_.max_engine_pages_per_engine,
                     " page-locations; this chain adds ", adding, "; nothing of it was stored"));
  }
  if (const uint64_t held = ns.tenant->engine_pages;
      held + adding > options_.max_engine_pages_per_tenant) {
    return absl::ResourceExhaustedError(
        absl::StrCat("max_engine_pages_per_tenant: the engines of tenant ", ns.id.tenant, " hold ",
                     held, " of its ", options_.max_engine_pages_per_tenant,
                     " page-locations; this chain adds ", adding, "; nothing of it was stored"));
  }
  if (!path.empty() && path.back().matched < path.back().node->size()) {
    path.back().node = SplitNode(path.back().node, path.back().matched);
  }
  const int64_t committed_ms = absl::ToUnixMillis(now);
  const std::vector<BlockId> no_blocks(n, kNoBlock);
  const std::span<const BlockId> blocks(no_blocks);
  RadixNode* parent = ns.tree.root();
  for (const PathStep& step : path) {
    if (step.node->FindReplica(*pid) == nullptr) {
      AddReplica(step.node, *pid, blocks.subspan(step.first_page, step.matched), committed_ms);
    }
    parent = step.node;
  }
  if (in_tree < n) {
    RadixNode* leaf = ns.tree.AddChild(parent, pages.subspan(in_tree));
    policy_->OnLeafAdded(*leaf, nullptr, absl::ToDoubleSeconds(now - absl::UnixEpoch()));
    AddReplica(leaf, *pid, blocks.subspan(in_tree), committed_ms);
    path.push_back(PathStep{leaf, in_tree, n - in_tree});
  }
  // An engine storing a prefix is a use of it, as an insert is.
  const uint64_t stamp = recency_.NextStamp();
  const double now_s = absl::ToDoubleSeconds(now - absl::UnixEpoch());
  for (const PathStep& step : path) policy_->Touch(step.node, stamp, now_s, Access::kInsert);
  Emit(CacheEvent::Kind::kStored, ns, *pid, pages.subspan(in_pool));
  return n - in_pool;
}

absl::StatusOr<uint64_t> CacheIndex::RemoveEnginePages(const NamespaceId& ns_id,
                                                       std::span<const PageHash> pages,
                                                       const PoolKey& pool) {
  if (pages.empty()) return absl::InvalidArgumentError("page_hashes: no page to remove");
  WriterLock lock(this);
  ExpireLeasesLocked(clock_->Now());
  absl::StatusOr<Namespace*> found = FindNamespace(ns_id);
  if (!found.ok()) return found.status();
  Namespace& ns = **found;
  if (!budget_.Find(pool).has_value()) return 0;  // never stored anything
  absl::StatusOr<PoolId> pid = EnginePool(pool, /*create=*/false);
  if (!pid.ok()) return pid.status();

  std::vector<PathStep> path;
  const uint32_t n = static_cast<uint32_t>(pages.size());
  if (ns.tree.Walk(pages, &path) < n) return 0;  // the last page is not indexed at all
  RadixNode* node = path.back().node;
  if (node->FindReplica(*pid) == nullptr) return 0;  // nor held by this pool
  // Split so that the node starts at the chain's last page.
  const uint32_t offset = path.back().matched - 1;
  if (offset > 0) SplitNode(node, offset);
  return RemoveEngineSubtree(node, *pid, [&](const RadixNode& gone) {
    Emit(CacheEvent::Kind::kRemoved, ns, *pid, gone.pages);
  });
}

absl::StatusOr<uint64_t> CacheIndex::ClearEnginePool(const NamespaceId& ns_id,
                                                     const PoolKey& pool) {
  WriterLock lock(this);
  ExpireLeasesLocked(clock_->Now());
  absl::StatusOr<Namespace*> found = FindNamespace(ns_id);
  if (!found.ok()) return found.status();
  Namespace& ns = **found;
  if (!budget_.Find(pool).has_value()) return 0;
  absl::StatusOr<PoolId> pid = EnginePool(pool, /*create=*/false);
  if (!pid.ok()) return pid.status();
  std::vector<RadixNode*> tops;
  ns.tree.root()->children.ForEach([&](RadixNode* child) {
    if (child->FindReplica(*pid) != nullptr) tops.push_back(child);
  });
  uint64_t removed = 0;
  for (RadixNode* top : tops) removed += RemoveEngineSubtree(top, *pid, [](const RadixNode&) {});
  if (removed > 0) Emit(CacheEvent::Kind::kCleared, ns, *pid, {});
  return removed;
}

uint64_t CacheIndex::EnginePagesLocked(const std::string& engine_id) const {
  uint64_t pages = 0;
  for (Tier tier : {Tier::kGpu, Tier::kHost, Tier::kDisk}) {
    std::optional<PoolId> id = budget_.Find(PoolKey{engine_id, tier});
    if (id.has_value() && budget_.engine(*id)) pages += budget_.stats(*id).pages;
  }
  return pages;
}

uint64_t CacheIndex::PoolPages(const PoolKey& pool) const {
  absl::ReaderMutexLock lock(&mu_);
  std::optional<PoolId> id = budget_.Find(pool);
  return id.has_value() ? budget_.stats(*id).pages : 0;
}

}  // namespace kvcm
