#include "bench/replay/agent_backed_pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvcm::bench {
namespace {

absl::Status Internal(const PoolKey& pool, absl::string_view what, const absl::Status& cause) {
  return absl::InternalError(
      absl::StrCat("agent-backed pool ", pool.ToString(), ": ", what, ": ", cause.ToString()));
}

}  // namespace

AgentBackedPools::AgentBackedPools(CacheIndex* index) : index_(index) {
  index_->SetEventListener([this](const CacheEvent& event) { OnEvent(event); });
}

AgentBackedPools::~AgentBackedPools() { index_->SetEventListener(nullptr); }

absl::Status AgentBackedPools::AddPool(const PoolKey& pool, uint32_t num_blocks) {
  if (num_blocks == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool ", pool.ToString(), " holds no whole page: an agent needs a block"));
  }
  if (pools_.contains(pool)) {
    return absl::InvalidArgumentError(absl::StrCat("pool ", pool.ToString(), " is backed twice"));
  }
  pools_.emplace(pool, std::make_unique<Pool>(pool, num_blocks));
  return absl::OkStatus();
}

AgentBackedPools::Pool* AgentBackedPools::Find(const PoolKey& pool) {
  auto it = pools_.find(pool);
  return it == pools_.end() ? nullptr : it->second.get();
}

absl::StatusOr<uint64_t> AgentBackedPools::BytesPerPage(const NamespaceId& ns) {
  if (auto it = bytes_per_page_.find(ns); it != bytes_per_page_.end()) return it->second;
  absl::StatusOr<RegisterModelResult> found = index_->GetNamespace(ns);
  if (!found.ok()) return found.status();
  const uint64_t bytes = found->spec.BytesPerPage();
  bytes_per_page_.emplace(ns, bytes);
  return bytes;
}

void AgentBackedPools::Fail(absl::Status status) {
  if (error_.ok()) error_ = std::move(status);
}

absl::StatusOr<bool> AgentBackedPools::Store(const NamespaceId& ns, std::span<const PageHash> pages,
                                             const PoolKey& key, const MatchResult& match) {
  if (!error_.ok()) return error_;
  Pool* pool = Find(key);
  if (pool == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("pool ", key.ToString(), " is not backed"));
  }
  absl::StatusOr<uint64_t> bytes_per_page = BytesPerPage(ns);
  if (!bytes_per_page.ok()) return bytes_per_page.status();
  BlockLedger& ledger = pool->ledger;
  const uint32_t n = static_cast<uint32_t>(pages.size());

  // The blocks the worker holds already: the leading pages whose matched segment has a
  // replica in this pool (a pool is prefix-closed, so they are a prefix of the prompt).
  std::vector<BlockId> blocks;
  blocks.reserve(n);
  for (const MatchedSegment& seg : match.segments) {
    if (seg.first_page != blocks.size()) break;
    const auto reps = match.Replicas(seg);
    auto rep = std::find_if(reps.begin(), reps.end(),
                            [&](const MatchedReplica& r) { return *r.pool == key; });
    if (rep == reps.end()) break;
    const std::span<const BlockId> ids = match.BlockIds(seg, *rep);
    blocks.insert(blocks.end(), ids.begin(), ids.end());
  }
  blocks.resize(std::min<size_t>(blocks.size(), n));
  last_ns_ = ns;
  last_pool_ = pool;
  last_pages_.assign(pages.begin(), pages.end());
  last_blocks_ = blocks;
  const uint32_t held = static_cast<uint32_t>(blocks.size());
  if (held == n) return true;  // nothing to store: the worker's connector skips the insert

  // Allocate; when the agent is short, the manager evicts exactly the shortfall and the
  // victims' FreeBlocks (OnEvent) free their blocks before the second try.
  ++counters_.stores;
  const uint32_t count = n - held;
  absl::StatusOr<std::vector<BlockId>> fresh = ledger.Allocate(count, kEpoch, &ns);
  if (absl::IsResourceExhausted(fresh.status())) {
    ++counters_.short_allocations;
    // No store of this tenant is in flight (allocated, not committed): one runs at a time.
    const uint64_t shortfall = uint64_t{count - ledger.free_blocks()} * *bytes_per_page;
    absl::StatusOr<EvictResult> room =
        index_->EvictForAllocation(key, ns, shortfall, uint64_t{count} * *bytes_per_page);
    Settle();
    if (!error_.ok()) return error_;
    if (absl::IsResourceExhausted(room.status())) {
      ++counters_.room_refusals;
      return false;
    }
    if (!room.ok()) return Internal(key, "EvictForAllocation", room.status());
    fresh = ledger.Allocate(count, kEpoch, &ns);
    if (!fresh.ok()) {
      return Internal(key,
                      absl::StrCat("Allocate of ", count, " blocks after EvictForAllocation of ",
                                   shortfall, " bytes evicted ", room->evicted_pages, " pages"),
                      fresh.status());
    }
  } else if (!fresh.ok()) {
    return Internal(key, "Allocate", fresh.status());
  }
  blocks.insert(blocks.end(), fresh->begin(), fresh->end());

  // CommitBlocks: every page of the insert, the held ones as repeated commits.
  absl::StatusOr<uint64_t> generation = index_->PoolGeneration(key);
  if (!generation.ok()) return generation.status();
  const absl::Time committed_at = index_->Now();
  std::vector<CommitEntry> entries(n);
  for (uint32_t i = 0; i < n; ++i) {
    entries[i] = {
        .block = blocks[i], .page = pages[i], .parent = i > 0 ? pages[i - 1] : PageHash{}};
  }
  absl::StatusOr<std::vector<BlockId>> newly =
      ledger.Commit(ns, kEpoch, entries, "block_ids", absl::ToUnixMillis(committed_at));
  if (!newly.ok()) return Internal(key, "CommitBlocks", newly.status());
  std::vector<bool> newly_committed(n, false);
  for (uint32_t i = held; i < n; ++i) {
    newly_committed[i] = std::find(newly->begin(), newly->end(), blocks[i]) != newly->end();
  }

  absl::StatusOr<InsertResult> inserted = index_->Insert(ns, pages, key, blocks,
                                                         {.newly_committed = newly_committed,
                                                          .pool_generation = *generation,
                                                          .committed_at = committed_at});
  Settle();
  if (!error_.ok()) return error_;

  // ReleaseBlocks (the manager) then Free (the worker): everything this commit took when the
  // index refused, else the blocks of pages the pool held already with another block.
  std::vector<BlockId> release;
  std::vector<BlockId> spare;
  for (uint32_t i = held; i < n; ++i) {
    const bool duplicate = inserted.ok() && i < inserted->already_present_pages &&
                           inserted->existing_block_ids[i] != blocks[i];
    if (!inserted.ok() || duplicate) {
      spare.push_back(blocks[i]);
      if (newly_committed[i]) release.push_back(blocks[i]);
    }
  }
  if (!release.empty()) {
    if (absl::Status s = ledger.Release(release, kEpoch, "release.block_ids"); !s.ok()) {
      return Internal(key, "ReleaseBlocks", s);
    }
  }
  if (!spare.empty()) {
    if (absl::Status s = ledger.Free(spare, kEpoch); !s.ok()) return Internal(key, "Free", s);
    counters_.released_blocks += spare.size();
  }
  if (absl::IsResourceExhausted(inserted.status())) {
    ++counters_.insert_refusals;
    last_blocks_.resize(held);
    return false;
  }
  if (!inserted.ok()) return Internal(key, "Insert", inserted.status());
  for (uint32_t i = 0; i < inserted->already_present_pages; ++i) {
    blocks[i] = inserted->existing_block_ids[i];
  }
  last_blocks_ = std::move(blocks);
  return true;
}

void AgentBackedPools::OnEvent(const CacheEvent& event) {
  if (event.kind == CacheEvent::Kind::kRemoved) {
    Pool* pool = Find(event.pool);
    if (pool == nullptr) return;
    std::vector<BlockId> ids;
    for (BlockId id : event.block_ids) {
      if (id != kPendingBlock) ids.push_back(id);  // never reported: nothing to free
    }
    if (ids.empty()) return;
    if (absl::Status s = pool->ledger.FreeCommitted(ids, kEpoch, "free.block_ids"); !s.ok()) {
      Fail(Internal(event.pool, "FreeBlocks of an evicted replica", s));
      return;
    }
    counters_.freed_blocks += ids.size();
  } else if (event.kind == CacheEvent::Kind::kStored && event.demoted_from.has_value()) {
    Demote(event);
  }
}

void AgentBackedPools::Demote(const CacheEvent& event) {
  Pool* host = Find(event.pool);
  Pool* gpu = Find(*event.demoted_from);
  if (host == nullptr || gpu == nullptr) {
    Fail(
        absl::InternalError(absl::StrCat("a demotion from ", event.demoted_from->ToString(), " to ",
                                         event.pool.ToString(), ", a pool no ledger backs")));
    return;
  }
  Demotion d{.ns = event.ns,
             .pool = event.pool,
             .path = event.prefix,
             .first_page = static_cast<uint32_t>(event.prefix.size())};
  d.path.insert(d.path.end(), event.pages.begin(), event.pages.end());
  // CommandExecutor::Demote: the sources must be the agent's, the HOST blocks are allocated
  // without a namespace and committed as copies of the sources.
  const std::vector<BlockId>& sources = event.source_block_ids;
  if (gpu->ledger.Check(sources, kEpoch, /*writable=*/false, "demote.source_block_ids").ok()) {
    absl::StatusOr<std::vector<BlockId>> targets =
        host->ledger.Allocate(static_cast<uint32_t>(sources.size()), kEpoch, nullptr);
    if (targets.ok()) {
      for (size_t i = 0; i < sources.size(); ++i) {
        if (absl::Status s =
                host->ledger.CommitCopy((*targets)[i], gpu->ledger.Committed(sources[i]));
            !s.ok()) {
          Fail(Internal(event.pool, "CommitCopy", s));
          return;
        }
      }
      d.blocks = *std::move(targets);
    }
  }
  answered_.push_back(std::move(d));
}

void AgentBackedPools::Settle() {
  // AssignBlocks and AbandonPending demote nothing, so this loop ends.
  while (!answered_.empty()) {
    Demotion d = std::move(answered_.front());
    answered_.pop_front();
    if (d.blocks.empty()) {
      ++counters_.failed_demotions;
      (void)index_->AbandonPending(d.ns, d.path, d.first_page, d.pool);
      continue;
    }
    ++counters_.demotions;
    absl::StatusOr<std::vector<BlockId>> unassigned =
        index_->AssignBlocks(d.ns, d.path, d.first_page, d.pool, d.blocks);
    if (!unassigned.ok()) {
      Fail(Internal(d.pool, "AssignBlocks", unassigned.status()));
      return;
    }
    if (unassigned->empty()) continue;
    if (absl::Status s = Find(d.pool)->ledger.FreeCommitted(*unassigned, kEpoch, "free.block_ids");
        !s.ok()) {
      Fail(Internal(d.pool, "FreeBlocks of unassigned HOST blocks", s));
      return;
    }
    counters_.freed_blocks += unassigned->size();
  }
}

absl::Status AgentBackedPools::Check(bool full) {
  Settle();
  if (!error_.ok()) return error_;
  ++counters_.checks;
  for (const auto& [key, pool] : pools_) {
    const uint64_t indexed = index_->PoolPages(key);
    if (pool->ledger.committed_blocks() != indexed) {
      return absl::InternalError(absl::StrCat(
          "agent-backed pool ", key.ToString(), ": the ledger has ",
          pool->ledger.committed_blocks(), " committed blocks but the index ", indexed,
          " page-locations (", pool->ledger.free_blocks(), " of ", pool->ledger.num_blocks(),
          " blocks free; so far ", counters_.demotions, " demotions carried out, ",
          counters_.failed_demotions, " failed and abandoned)"));
    }
  }
  if (last_pool_ != nullptr && !last_blocks_.empty()) {
    const std::span<const PageHash> pages = std::span(last_pages_).first(last_blocks_.size());
    if (absl::Status s = last_pool_->ledger.CheckPages(last_blocks_, last_ns_, pages, "block_ids");
        !s.ok()) {
      return Internal(last_pool_->key, "the request's blocks", s);
    }
  }
  if (full) {
    ++counters_.full_checks;
    for (const auto& [key, pool] : pools_) {
      if (absl::Status s = FullCheck(*pool); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status AgentBackedPools::FullCheck(const Pool& pool) const {
  // The ledger's committed blocks as chains: per namespace, page -> (block, parent).
  struct Entry {
    BlockId block;
    PageHash parent;
    bool has_child = false;
  };
  absl::flat_hash_map<NamespaceId, absl::flat_hash_map<PageHash, Entry>> chains;
  absl::Status status;
  pool.ledger.ForEachCommitted([&](const CommittedBlock& b) {
    auto [it, added] = chains[*b.ns].try_emplace(b.page, Entry{b.block, b.parent});
    if (!added && status.ok()) {
      status = absl::InternalError(absl::StrCat("agent-backed pool ", pool.key.ToString(),
                                                ": blocks ", it->second.block, " and ", b.block,
                                                " both hold page ", b.page.ToHex()));
    }
  });
  if (!status.ok()) return status;
  std::vector<PageHash> path;
  std::vector<BlockId> want;
  for (auto& [ns, entries] : chains) {
    for (auto& [page, e] : entries) {
      if (e.parent == PageHash{}) continue;
      auto parent = entries.find(e.parent);
      if (parent == entries.end()) {
        return absl::InternalError(absl::StrCat("agent-backed pool ", pool.key.ToString(),
                                                ": block ", e.block, " holds page ", page.ToHex(),
                                                " but no block holds its parent"));
      }
      parent->second.has_child = true;
    }
    // One probe Match per leaf: the index must hold the whole chain in this pool, each page
    // in the block the ledger committed to it.
    for (const auto& [leaf, e] : entries) {
      if (e.has_child) continue;
      path.clear();
      want.clear();
      for (PageHash p = leaf;;) {
        const Entry& step = entries.at(p);
        path.push_back(p);
        want.push_back(step.block);
        if (step.parent == PageHash{}) break;
        p = step.parent;
      }
      std::reverse(path.begin(), path.end());
      std::reverse(want.begin(), want.end());
      absl::StatusOr<MatchResult> m = index_->Match(ns, path, {.probe = true});
      if (!m.ok()) return Internal(pool.key, "probe Match", m.status());
      std::vector<BlockId> got;
      for (const MatchedSegment& seg : m->segments) {
        const auto reps = m->Replicas(seg);
        auto rep = std::find_if(reps.begin(), reps.end(),
                                [&](const MatchedReplica& r) { return *r.pool == pool.key; });
        if (rep == reps.end()) break;
        const std::span<const BlockId> ids = m->BlockIds(seg, *rep);
        got.insert(got.end(), ids.begin(), ids.end());
      }
      if (got != want) {
        size_t i = 0;
        while (i < got.size() && got[i] == want[i]) ++i;
        return absl::InternalError(
            absl::StrCat("agent-backed pool ", pool.key.ToString(), ": the ledger commits block ",
                         want[i], " to page ", path[i].ToHex(), " (depth ", i, " of a ",
                         path.size(), "-page chain), but the index ",
                         i < got.size() ? absl::StrCat("holds that page in block ", got[i])
                                        : std::string("does not hold that page in this pool")));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcm::bench
