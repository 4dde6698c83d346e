// CacheIndex: pool budgets, eviction (by policy, from a pool or a namespace), demotion to
// the HOST tier and its block assignment, dropping a pool, deleting a namespace and
// eviction regret. See cache_index.h.
#include <algorithm>
#include <cassert>
#include <queue>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "server/core/cache_index.h"
#include "server/core/cache_index_internal.h"

namespace kvcm {

std::vector<BlockId> CacheIndex::RemoveReplica(RadixNode* node, PoolId pool,
                                               absl::FunctionRef<void(RadixNode*)> on_last) {
  Namespace* ns = OwnerOf(node);
  auto it = std::find_if(node->replicas.begin(), node->replicas.end(),
                         [pool](const Replica& r) { return r.pool == pool; });
  assert(it != node->replicas.end() && (it->evictable || budget_.engine(pool)));
  assert(it->child_refs == 0);
  if (it->evictable) policy_->Remove(node, pool);
  UntrackExpiry(node, *it);
  std::vector<BlockId> block_ids = std::move(it->block_ids);
  node->replicas.erase(it);
  const uint64_t bytes = NodeBytes(node);
  ledger_.Unstore(*ns->tenant, pool, node->size(), bytes, node->pin_count > 0);
  if (node->pin_count > 0) budget_.Unpin(pool, bytes);  // only an engine's replica is pinned
  budget_.Refund(pool, node->size(), bytes);
  ns->tree.AddPageLocations(-int64_t{node->size()});

  RadixNode* parent = node->parent;
  if (!parent->is_root()) {
    Replica* up = parent->FindReplica(pool);
    --up->child_refs;
    RefreshCandidate(parent, *up);
  }
  if (!node->replicas.empty()) {
    policy_->Rescore(node);  // scores may count replicas
  } else if (node->pin_count == 0) {
    // No replica left means no located descendant either (prefix closure), and an unpinned
    // node has no pinned one: a leaf.
    on_last(node);
    ns->tree.Remove(node);
  }
  return block_ids;
}

bool CacheIndex::HasLiveReplica(const RadixNode* node) const {
  for (const Replica& r : node->replicas) {
    if (!budget_.retired(r.pool)) return true;
  }
  return false;
}

uint64_t CacheIndex::EvictReplica(RadixNode* node, PoolId pool, absl::Time now) {
  const Namespace& ns = *OwnerOf(node);
  const uint64_t bytes = NodeBytes(node);
  const uint32_t pages = node->size();
  // The node may go inside RemoveReplica: copy what the event needs first.
  std::vector<PageHash> removed_pages = node->pages;
  std::vector<BlockId> block_ids = RemoveReplica(node, pool, [&](RadixNode* last) {
    if (history_.enabled()) {
      history_.Record(last->pages[0], {.at = now,
                                       .pages = last->size(),
                                       .hits = last->hits,
                                       .last_access_s = last->last_access_s,
                                       .policy_tag = policy_->OnGhostAdded(
                                           *last, absl::ToDoubleSeconds(now - absl::UnixEpoch()))});
    }
  });
  counters_.evicted_pages += pages;
  counters_.evicted_bytes += bytes;
  Emit(CacheEvent::Kind::kRemoved, ns, pool, removed_pages, std::move(block_ids),
       CacheEvent::Reason::kEvicted);
  return bytes;
}

bool CacheIndex::DemoteToHost(RadixNode* node, PoolId gpu, const Incoming& incoming) {
  std::optional<PoolId> host = budget_.Find(PoolKey{budget_.key(gpu).agent_id, Tier::kHost});
  if (!host.has_value()) return false;
  // The node and the ancestors the host pool lacks: a suffix of the path, since the host
  // pool is prefix-closed.
  std::vector<RadixNode*> chain;
  uint64_t need = 0;
  for (RadixNode* n = node; !n->is_root() && n->FindReplica(*host) == nullptr; n = n->parent) {
    chain.push_back(n);
    need += NodeBytes(n);
  }
  if (chain.empty()) return true;  // already has a host copy
  if (need > budget_.capacity(*host)) return false;
  // The copies are the tenant's bytes too: a tenant at its quota loses the page instead.
  const Tenant& tenant = *OwnerOf(node)->tenant;
  const uint64_t incoming_bytes = incoming.tenant == &tenant ? incoming.bytes : 0;
  if (ledger_.QuotaShortfall(tenant, need + incoming_bytes) > 0) return false;
  // A demoted copy keeps its age (it is the same data, moved): one already past it leaves.
  const int64_t cutoff_ms = OwnerOf(node)->retention.CutoffMs(clock_->Now());
  for (const RadixNode* n : chain) {
    if (n->FindReplica(gpu)->committed_ms <= cutoff_ms) return false;
  }
  if (const uint64_t shortfall = budget_.Shortfall(*host, need); shortfall > 0) {
    PinPath(node);  // the path's host pages must stay while the host pool makes room
    const bool room = budget_.evictable(*host) >= shortfall;
    // Host victims leave (only GPU pools demote); pending ones stay (EvictLocked).
    if (room) EvictLocked(*host, shortfall, Incoming{nullptr, 0}, /*skip_pending=*/true);
    UnpinPath(node);
    if (!room || budget_.Shortfall(*host, need) > 0) return false;
  }
  // One event for the whole chain: the pages, the GPU blocks to copy them from, and the
  // path above them, so the agent's answer can be matched back to these replicas.
  CacheEvent event{.kind = CacheEvent::Kind::kStored, .demoted_from = budget_.key(gpu)};
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    RadixNode* n = *it;
    AddReplica(n, *host, std::vector<BlockId>(n->size(), kPendingBlock),
               n->FindReplica(gpu)->committed_ms);
    const Replica* source = n->FindReplica(gpu);
    event.pages.insert(event.pages.end(), n->pages.begin(), n->pages.end());
    event.source_block_ids.insert(event.source_block_ids.end(), source->block_ids.begin(),
                                  source->block_ids.end());
  }
  if (listener_) {
    std::vector<const RadixNode*> above;
    for (const RadixNode* n = chain.back()->parent; !n->is_root(); n = n->parent) {
      above.push_back(n);
    }
    for (auto it = above.rbegin(); it != above.rend(); ++it) {
      event.prefix.insert(event.prefix.end(), (*it)->pages.begin(), (*it)->pages.end());
    }
    const Namespace& ns = *OwnerOf(node);
    event.ns = ns.id;
    event.pool = budget_.key(*host);
    listener_(event);
  }
  return true;
}

absl::StatusOr<std::vector<BlockId>> CacheIndex::AssignBlocks(const NamespaceId& ns_id,
                                                              std::span<const PageHash> pages,
                                                              uint32_t first_page,
                                                              const PoolKey& pool,
                                                              std::span<const BlockId> block_ids) {
  if (first_page > pages.size() || block_ids.size() != pages.size() - first_page) {
    return absl::InvalidArgumentError(absl::StrCat("block_ids has ", block_ids.size(),
                                                   " entries for pages ", first_page, "..",
                                                   pages.size(), " of the path"));
  }
  if (std::find(block_ids.begin(), block_ids.end(), kPendingBlock) != block_ids.end()) {
    return absl::InvalidArgumentError("block_ids must not contain the pending block id");
  }
  WriterLock lock(this);
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_id);
  if (!ns.ok()) return ns.status();
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();

  std::vector<bool> assigned(block_ids.size(), false);
  thread_local std::vector<PathStep> path;
  (*ns)->tree.Walk(pages, &path);
  for (const PathStep& step : path) {
    Replica* r = step.node->FindReplica(*id);
    if (r == nullptr) break;  // prefix-closed: no later step holds the pool either
    for (uint32_t i = 0; i < step.matched; ++i) {
      const uint32_t page = step.first_page + i;
      if (page < first_page || r->block_ids[i] != kPendingBlock) continue;
      r->block_ids[i] = block_ids[page - first_page];
      assigned[page - first_page] = true;
    }
  }
  std::vector<BlockId> unassigned;
  for (size_t i = 0; i < block_ids.size(); ++i) {
    if (!assigned[i]) unassigned.push_back(block_ids[i]);
  }
  return unassigned;
}

absl::StatusOr<uint64_t> CacheIndex::AbandonPending(const NamespaceId& ns_id,
                                                    std::span<const PageHash> pages,
                                                    uint32_t first_page, const PoolKey& pool) {
  if (first_page > pages.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_page ", first_page, " is past the ", pages.size(), " pages"));
  }
  WriterLock lock(this);
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_id);
  if (!ns.ok()) return ns.status();
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();

  std::vector<PathStep> path;
  (*ns)->tree.Walk(pages, &path);
  uint64_t removed = 0;
  for (size_t i = path.size(); i-- > 0;) {
    RadixNode* node = path[i].node;
    if (path[i].first_page < first_page || path[i].matched < node->size()) break;
    Replica* r = node->FindReplica(*id);
    if (r == nullptr) continue;  // the demotion's pages were evicted from the pool meanwhile
    const bool pending = std::all_of(r->block_ids.begin(), r->block_ids.end(),
                                     [](BlockId b) { return b == kPendingBlock; });
    if (!pending || !r->evictable) break;
    std::vector<PageHash> node_pages = node->pages;
    std::vector<BlockId> blocks = RemoveReplica(node, *id, [](RadixNode*) {});
    removed += node_pages.size();
    Emit(CacheEvent::Kind::kRemoved, **ns, *id, node_pages, std::move(blocks));
  }
  return removed;
}

absl::StatusOr<DropPoolResult> CacheIndex::DropPool(const PoolKey& key, bool forget) {
  WriterLock lock(this);
  absl::StatusOr<PoolId> found = FindPool(key);
  if (!found.ok()) return found.status();
  const PoolId retired = *found;
  const DropPoolResult result{budget_.stats(retired).pages, budget_.used(retired)};
  if (forget) {
    budget_.Retire(retired);
  } else {
    // A fresh id even for an empty pool: an insert that began in the old incarnation
    // (InsertOptions::pool_generation) must not land in the new one.
    budget_.Replace(retired);
  }
  policy_->OnPoolRetired(retired);
  ledger_.DropPool(retired);
  // No incarnation takes the reservations over.
  if (forget) ledger_.ReleasePool(key);
  if (result.dropped_pages == 0) return result;  // nothing to forget
  sweeping_.push_back(retired);
  counters_.dropped_pages += result.dropped_pages;
  for (const auto& [id, ns] : namespaces_) Emit(CacheEvent::Kind::kCleared, *ns, retired, {});
  return result;
}

absl::StatusOr<DeleteNamespaceResult> CacheIndex::DeleteNamespace(const NamespaceId& ns_id) {
  WriterLock lock(this);
  auto it = namespaces_.find(ns_id);
  if (it == namespaces_.end()) {
    return absl::NotFoundError(absl::StrCat("namespace ", ns_id.ToString(), " is not registered"));
  }
  Namespace& ns = *it->second;
  DeleteNamespaceResult result;
  result.dropped_pins = leases_.ForgetTree(&ns.tree, [this](const Lease& lease) { EndPin(lease); });
  // Preorder, then removed back to front: every node after its descendants, so each replica
  // is an unpinned leaf of its pool (child_refs 0) when it goes.
  std::vector<RadixNode*> order;
  std::vector<RadixNode*> stack;
  ns.tree.root()->children.ForEach([&](RadixNode* child) { stack.push_back(child); });
  while (!stack.empty()) {
    RadixNode* node = stack.back();
    stack.pop_back();
    order.push_back(node);
    node->children.ForEach([&](RadixNode* child) { stack.push_back(child); });
  }
  for (auto n = order.rbegin(); n != order.rend(); ++n) {
    RadixNode* node = *n;
    const std::vector<PageHash> pages = node->pages;
    while (!node->replicas.empty()) {
      const PoolId pool = node->replicas.back().pool;
      const bool live = !budget_.retired(pool);
      const bool last = node->replicas.size() == 1;
      result.removed_pages += pages.size();
      std::vector<BlockId> blocks = RemoveReplica(node, pool, [](RadixNode*) {});
      if (budget_.engine(pool)) blocks.clear();  // an engine frees its own blocks
      // A retired pool's blocks went with its agent's old epoch: nothing to free.
      if (live) Emit(CacheEvent::Kind::kRemoved, ns, pool, pages, std::move(blocks));
      if (last) break;  // RemoveReplica removed the node from the tree
    }
  }
  Tenant& tenant = *ns.tenant;
  --tenant.namespaces;
  namespaces_.erase(it);
  ledger_.MaybeForget(tenant);
  return result;
}

SweepResult CacheIndex::SweepRetired(size_t max_replicas) {
  WriterLock lock(this);
  SweepResult result;
  // Pools whose replicas are all pinned for now go to the back of the queue once.
  size_t stuck = 0;
  while (!sweeping_.empty() && result.removed_replicas < max_replicas && stuck < sweeping_.size()) {
    const PoolId pool = sweeping_.front();
    if (budget_.stats(pool).pages == 0) {
      sweeping_.pop_front();
      continue;
    }
    std::optional<EvictionCandidate> victim = policy_->Victim(pool);
    if (!victim.has_value()) {
      sweeping_.pop_front();
      sweeping_.push_back(pool);
      ++stuck;
      continue;
    }
    RemoveReplica(victim->node, pool, [](RadixNode*) {});
    ++result.removed_replicas;
  }
  for (PoolId pool : sweeping_) result.remaining_pages += budget_.stats(pool).pages;
  return result;
}

EvictResult CacheIndex::EvictLocked(PoolId pool, uint64_t bytes, const Incoming& incoming,
                                    bool skip_pending) {
  EvictResult result;
  const absl::Time now = clock_->Now();
  std::vector<RadixNode*> passed_over;  // pending replicas, out of the candidates meanwhile
  while (result.evicted_bytes < bytes) {
    std::optional<EvictionCandidate> victim = policy_->Victim(pool);
    if (!victim.has_value()) break;
    RadixNode* node = victim->node;
    if (skip_pending) {
      Replica* replica = node->FindReplica(pool);
      if (absl::c_linear_search(replica->block_ids, kPendingBlock)) {
        policy_->Remove(node, pool);
        replica->evictable = false;
        passed_over.push_back(node);
        continue;
      }
    }
    if (policy_->trims_nodes()) {
      // Evict only the tail pages still needed; the head stays cached (and matchable).
      const uint64_t page_bytes = node->tree->bytes_per_page();
      const uint64_t pages_needed = (bytes - result.evicted_bytes + page_bytes - 1) / page_bytes;
      if (pages_needed < node->size()) {
        SplitNode(node, node->size() - static_cast<uint32_t>(pages_needed));
      }
    }
    if (policy_->demotes_to_host() && budget_.key(pool).tier == Tier::kGpu &&
        DemoteToHost(node, pool, incoming)) {
      result.demoted_pages += node->size();
      counters_.demoted_pages += node->size();
    }
    result.evicted_pages += node->size();
    result.evicted_bytes += EvictReplica(node, pool, now);
  }
  for (RadixNode* node : passed_over) RefreshCandidate(node, *node->FindReplica(pool));
  return result;
}

void CacheIndex::ForgetOldEvictions(absl::Time now) { history_.Forget(now); }

void CacheIndex::CountRegret(std::span<const PageHash> missed, absl::Time now) {
  if (missed.empty() || history_.empty()) return;
  // Runs past the window may not be forgotten yet (a shared match leaves that to
  // ApplyAccessesLocked): they do not count.
  const EvictionHistory::Run* run = history_.FindRecent(missed[0], now);
  if (run == nullptr) return;
  absl::MutexLock lock(&regret_mu_);
  if (run->regretted) return;
  run->regretted = true;  // count each eviction once
  match_counters_.eviction_regret_pages.fetch_add(std::min<uint64_t>(run->pages, missed.size()),
                                                  std::memory_order_relaxed);
}

absl::Status CacheIndex::SetPoolCapacity(const PoolKey& pool, uint64_t capacity_bytes) {
  if (pool.agent_id.empty()) return absl::InvalidArgumentError("pool.agent_id must be set");
  WriterLock lock(this);
  std::optional<PoolId> id = budget_.Find(pool);
  if (id.has_value()) {
    if (absl::Status s = NotEnginePool(*id, pool, "registered by an agent"); !s.ok()) return s;
  }
  if (id.has_value() && budget_.used(*id) > capacity_bytes) {
    const uint64_t excess = budget_.used(*id) - capacity_bytes;
    if (budget_.evictable(*id) < excess) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "pool ", pool.ToString(), ": capacity ", capacity_bytes, " would need evicting ", excess,
          " bytes but only ", budget_.evictable(*id), " are unpinned"));
    }
    EvictLocked(*id, excess);
  }
  budget_.SetCapacity(id.has_value() ? *id : budget_.Intern(pool, capacity_bytes), capacity_bytes);
  return absl::OkStatus();
}

absl::StatusOr<EvictResult> CacheIndex::EvictFromPool(const PoolKey& pool, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("bytes must be > 0");
  WriterLock lock(this);
  ExpireLeasesLocked(clock_->Now());
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();
  if (absl::Status s = NotEnginePool(*id, pool, "evicted"); !s.ok()) return s;
  if (bytes > budget_.used(*id)) {
    return absl::OutOfRangeError(absl::StrCat("bytes ", bytes, " exceeds the ", budget_.used(*id),
                                              " bytes pool ", pool.ToString(), " holds"));
  }
  if (bytes > budget_.evictable(*id)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "bytes ", bytes, " exceeds the ", budget_.evictable(*id), " unpinned bytes of pool ",
        pool.ToString(), " (", budget_.pinned(*id), " pinned)"));
  }
  return EvictLocked(*id, bytes);
}

absl::StatusOr<EvictResult> CacheIndex::EvictForAllocation(const PoolKey& pool,
                                                           const NamespaceId& ns_id,
                                                           uint64_t shortfall_bytes,
                                                           uint64_t allocation_bytes,
                                                           uint64_t in_flight_bytes) {
  if (shortfall_bytes == 0) return absl::InvalidArgumentError("shortfall must be > 0");
  WriterLock lock(this);
  ExpireLeasesLocked(clock_->Now());
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();
  if (absl::Status s = NotEnginePool(*id, pool, "evicted"); !s.ok()) return s;
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_id);
  if (!ns.ok()) return ns.status();
  if (absl::Status s = ledger_.CheckShare(*(*ns)->tenant, *id, in_flight_bytes + allocation_bytes,
                                          "its stores in flight and the allocation");
      !s.ok()) {
    ++counters_.allocation_room_refusals;
    return s;
  }
  const uint64_t pages_before = counters_.evicted_pages;
  const uint64_t demoted_before = counters_.demoted_pages;
  absl::StatusOr<uint64_t> evicted =
      MakeRoom(*(*ns)->tenant, std::max(allocation_bytes, shortfall_bytes), *id, pool,
               shortfall_bytes, "the allocation");
  if (!evicted.ok()) {
    ++counters_.allocation_room_refusals;
    return evicted.status();
  }
  EvictResult result{.evicted_bytes = *evicted,
                     .evicted_pages = counters_.evicted_pages - pages_before,
                     .demoted_pages = counters_.demoted_pages - demoted_before};
  ++counters_.allocation_room_calls;
  counters_.allocation_evicted_pages += result.evicted_pages;
  return result;
}

absl::StatusOr<EvictResult> CacheIndex::EvictFromNamespace(const NamespaceId& ns_id,
                                                           uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("bytes must be > 0");
  WriterLock lock(this);
  const absl::Time now = clock_->Now();
  ExpireLeasesLocked(now);
  absl::StatusOr<Namespace*> found = FindNamespace(ns_id);
  if (!found.ok()) return found.status();
  Namespace& ns = **found;

  // One pass over the tree: the candidates of every pool, in the policy's cross-pool order,
  // and the bytes held and pinned by live replicas (retired ones, not swept yet, are no
  // longer the namespace's).
  struct Entry {
    double priority;
    RadixNode* node;
    PoolId pool;
    bool operator>(const Entry& o) const { return priority > o.priority; }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  uint64_t used = 0, pinned = 0;
  std::vector<RadixNode*> stack = {ns.tree.root()};
  while (!stack.empty()) {
    RadixNode* node = stack.back();
    stack.pop_back();
    for (const Replica& r : node->replicas) {
      // Engine pools are the engines' to evict.
      if (budget_.retired(r.pool) || budget_.engine(r.pool)) continue;
      used += NodeBytes(node);
      if (node->pin_count > 0) pinned += NodeBytes(node);
      if (r.evictable) heap.push({policy_->Priority(node, r.pool), node, r.pool});
    }
    node->children.ForEach([&](RadixNode* child) { stack.push_back(child); });
  }
  if (bytes > used) {
    return absl::OutOfRangeError(absl::StrCat("bytes ", bytes, " exceeds the ", used,
                                              " bytes namespace ", ns_id.ToString(), " holds"));
  }
  if (bytes > used - pinned) {
    return absl::ResourceExhaustedError(absl::StrCat("bytes ", bytes, " exceeds the ",
                                                     used - pinned, " unpinned bytes of namespace ",
                                                     ns_id.ToString()));
  }

  EvictResult result;
  while (result.evicted_bytes < bytes && !heap.empty()) {
    Entry e = heap.top();
    heap.pop();
    RadixNode* parent = e.node->parent;
    result.evicted_pages += e.node->size();
    result.evicted_bytes += EvictReplica(e.node, e.pool, now);
    if (!parent->is_root()) {
      const Replica* up = parent->FindReplica(e.pool);
      if (up->evictable) heap.push({policy_->Priority(parent, e.pool), parent, e.pool});
    }
  }
  return result;
}

}  // namespace kvcm
