#include "server/core/cache_index.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "server/core/cache_index_internal.h"
#include "server/core/policies/registry.h"

namespace kvcm {

PolicyContext CacheIndexOptions::policy_context() const {
  return PolicyContext{.next_use = next_use,
                       .reuse_credit = reuse_credit,
                       .adaptive = adaptive,
                       .density = density,
                       .conversation = conversation,
                       .select = select,
                       .clock = clock,
                       .regret_window = regret_window};
}

absl::Status CacheIndexOptions::Validate() const {
  if (auto p = MakeEvictionPolicy(policy, policy_context()); !p.ok()) return p.status();
  if (default_lease_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("default_lease_ttl must be positive");
  }
  if (max_lease_ttl < default_lease_ttl) {
    return absl::InvalidArgumentError("max_lease_ttl must be >= default_lease_ttl");
  }
  if (expired_pin_memory < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("expired_pin_memory must not be negative");
  }
  if (regret_window < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("regret_window must not be negative");
  }
  if (max_namespaces < 1) return absl::InvalidArgumentError("max_namespaces must be >= 1");
  if (max_pins_per_tenant < 1) {
    return absl::InvalidArgumentError("max_pins_per_tenant must be >= 1");
  }
  if (max_namespaces_per_tenant < 1) {
    return absl::InvalidArgumentError("max_namespaces_per_tenant must be >= 1");
  }
  if (tenant_max_bytes > 0 && tenant_max_pinned_bytes > tenant_max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tenant_max_pinned_bytes (", tenant_max_pinned_bytes,
                     ") must be at most tenant_max_bytes (", tenant_max_bytes, ")"));
  }
  if (default_tenant_pool_share_pct < 1 || default_tenant_pool_share_pct > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_tenant_pool_share_pct must be in [1, 100] (100: no share), got ",
                     default_tenant_pool_share_pct));
  }
  if (max_engine_pages_per_engine < 1) {
    return absl::InvalidArgumentError("max_engine_pages_per_engine must be >= 1");
  }
  if (max_engine_pages_per_tenant < 1) {
    return absl::InvalidArgumentError("max_engine_pages_per_tenant must be >= 1");
  }
  if (default_max_page_age < absl::ZeroDuration() ||
      default_max_page_age > absl::Seconds(kMaxPageAgeS)) {
    return absl::InvalidArgumentError(absl::StrCat("default_max_page_age must be in [0, ",
                                                   kMaxPageAgeS, " s], got ",
                                                   absl::FormatDuration(default_max_page_age)));
  }
  return absl::OkStatus();
}

CacheIndex::CacheIndex(CacheIndexOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : RealClock::Get()),
      ledger_(TenantQuotas{.max_bytes = options_.tenant_max_bytes,
                           .max_pinned_bytes = options_.tenant_max_pinned_bytes,
                           .max_pins = options_.max_pins_per_tenant,
                           .pool_share_pct = options_.default_tenant_pool_share_pct},
              budget_),
      policy_(*MakeEvictionPolicy(options_.policy, options_.policy_context())),
      leases_(options_.expired_pin_memory),
      history_(options_.regret_window) {
  // Quota evictions take a tenant's own candidates, in the policy's order.
  if (options_.tenant_max_bytes > 0) policy_->TrackGroups();
}

CacheIndex::~CacheIndex() = default;

absl::StatusOr<std::unique_ptr<CacheIndex>> CacheIndex::Create(CacheIndexOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::make_unique<CacheIndex>(std::move(options));
}

void CacheIndex::SetEventListener(CacheEventListener listener) {
  WriterLock lock(this);
  listener_ = std::move(listener);
}

absl::StatusOr<CacheIndex::Namespace*> CacheIndex::FindNamespace(const NamespaceId& ns) const {
  auto it = namespaces_.find(ns);
  if (it == namespaces_.end()) {
    return absl::NotFoundError(absl::StrCat("namespace ", ns.ToString(), " is not registered"));
  }
  return it->second.get();
}

absl::StatusOr<PoolId> CacheIndex::FindPool(const PoolKey& pool) const {
  std::optional<PoolId> id = budget_.Find(pool);
  if (!id.has_value()) {
    return absl::NotFoundError(absl::StrCat("pool ", pool.ToString(), " is not registered"));
  }
  return *id;
}

namespace {

// What RegisterModel and GetNamespace answer about a namespace.
RegisterModelResult ResultOf(const CacheIndex::Namespace& ns, bool created) {
  return RegisterModelResult{
      .spec = ns.spec,
      .hash_key = ns.key,
      .created = created,
      .registered_max_page_age = ns.registered_max_age,
      .max_page_age = ns.retention.limited() ? ns.retention.max_age() : absl::ZeroDuration()};
}

}  // namespace

absl::StatusOr<RegisterModelResult> CacheIndex::RegisterModel(const NamespaceId& ns,
                                                              const ModelSpec& spec,
                                                              NamespaceSource source,
                                                              absl::Duration max_page_age) {
  if (ns.tenant.empty() || ns.model.empty()) {
    return absl::InvalidArgumentError("namespace.tenant and namespace.model must be set");
  }
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  if (max_page_age < absl::ZeroDuration() || max_page_age > absl::Seconds(kMaxPageAgeS)) {
    return absl::InvalidArgumentError(absl::StrCat("max_page_age_s must be in [0, ", kMaxPageAgeS,
                                                   "] (0: the manager's default), got ",
                                                   absl::ToInt64Seconds(max_page_age)));
  }
  WriterLock lock(this);
  auto it = namespaces_.find(ns);
  if (it != namespaces_.end()) {
    Namespace& existing = *it->second;
    if (!existing.spec.CompatibleWith(spec)) {
      ModelSpec same_layout = spec;
      same_layout.kv_layout = existing.spec.kv_layout;
      if (existing.spec == same_layout) {
        return absl::FailedPreconditionError(
            absl::StrCat("namespace ", ns.ToString(), " is registered with kv_layout \"",
                         existing.spec.kv_layout, "\"; this spec has \"", spec.kv_layout, "\""));
      }
      return absl::FailedPreconditionError(
          absl::StrCat("namespace ", ns.ToString(), " is registered with spec {",
                       existing.spec.DebugString(), "}, not {", spec.DebugString(), "}"));
    }
    // A namespace that stated no layout takes the first one stated, by a client or an
    // agent's inventory (not a reader), and refuses any other from then on.
    if (source != NamespaceSource::kReader && existing.spec.kv_layout.empty()) {
      existing.spec.kv_layout = spec.kv_layout;
    }
    // A retention limit only tightens: whoever asks for less keeps less.
    if (source != NamespaceSource::kReader && max_page_age > absl::ZeroDuration() &&
        (existing.registered_max_age == absl::ZeroDuration() ||
         max_page_age < existing.registered_max_age)) {
      SetMaxPageAge(existing, max_page_age);
    }
    return ResultOf(existing, false);
  }
  if (source == NamespaceSource::kReader) {
    return absl::NotFoundError(absl::StrCat(
        "namespace ", ns.ToString(),
        " is not registered (a router only reads an existing namespace; a worker or an "
        "engine of the tenant creates it)"));
  }
  const Tenant* known = ledger_.Find(ns.tenant);
  const uint32_t tenant_count = known == nullptr ? 0 : known->namespaces;
  if (source == NamespaceSource::kClient) {
    if (namespaces_.size() >= options_.max_namespaces) {
      return absl::ResourceExhaustedError(absl::StrCat("max_namespaces: the manager holds ",
                                                       namespaces_.size(), " namespaces already; ",
                                                       ns.ToString(), " was not created"));
    }
    if (tenant_count >= options_.max_namespaces_per_tenant) {
      return absl::ResourceExhaustedError(
          absl::StrCat("max_namespaces_per_tenant: tenant ", ns.tenant, " has ", tenant_count,
                       " namespaces already; ", ns.ToString(), " was not created"));
    }
  }
  Tenant& tenant = ledger_.Intern(ns.tenant);
  ++tenant.namespaces;
  HashKey key = DeriveNamespaceKey(options_.hash_secret, ns.tenant, ns.model);
  // The byte-blind arm charges what an MHA-shaped cache would hold for the same tokens.
  const uint64_t page_bytes = options_.policy == "lru-mha"
                                  ? spec.MhaShapedBytesPerToken() * spec.page_size_tokens
                                  : spec.BytesPerPage();
  auto [added, inserted] =
      namespaces_.emplace(ns, std::make_unique<Namespace>(ns, spec, key, page_bytes));
  added->second->tenant = &tenant;
  added->second->tree.set_group(tenant.group);
  SetMaxPageAge(*added->second, max_page_age);
  return ResultOf(*added->second, true);
}

absl::StatusOr<RegisterModelResult> CacheIndex::GetNamespace(const NamespaceId& ns) const {
  absl::ReaderMutexLock lock(&mu_);
  absl::StatusOr<Namespace*> found = FindNamespace(ns);
  if (!found.ok()) return found.status();
  return ResultOf(**found, false);
}

bool CacheIndex::HasPool(const PoolKey& pool) const {
  absl::ReaderMutexLock lock(&mu_);
  return budget_.Find(pool).has_value();
}

absl::StatusOr<uint64_t> CacheIndex::PoolGeneration(const PoolKey& pool) const {
  absl::ReaderMutexLock lock(&mu_);
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();
  return uint64_t{*id};
}

absl::StatusOr<std::vector<PageHash>> CacheIndex::HashTokens(
    const NamespaceId& ns, std::span<const int32_t> tokens) const {
  absl::StatusOr<RegisterModelResult> info = GetNamespace(ns);
  if (!info.ok()) return info.status();
  // Hash outside the lock: it is the expensive part of a token-based request.
  return HashPages(info->hash_key, tokens, info->spec.page_size_tokens);
}

absl::StatusOr<absl::Duration> CacheIndex::LeaseTtl(absl::Duration requested) const {
  if (requested < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lease_ttl must not be negative");
  }
  if (requested == absl::ZeroDuration()) return options_.default_lease_ttl;
  if (requested > options_.max_lease_ttl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_ttl_ms ", absl::ToInt64Milliseconds(requested), " exceeds max_lease_ttl_ms ",
        absl::ToInt64Milliseconds(options_.max_lease_ttl)));
  }
  return requested;
}

void CacheIndex::RefreshCandidate(RadixNode* node, Replica& replica) {
  const bool want = !node->is_root() && node->pin_count == 0 && replica.child_refs == 0 &&
                    !budget_.engine(replica.pool);
  if (want == replica.evictable) return;
  replica.evictable = want;
  if (want) {
    policy_->Add(node, replica.pool);
  } else {
    policy_->Remove(node, replica.pool);
  }
}

RadixNode* CacheIndex::SplitNode(RadixNode* node, uint32_t k) {
  RadixNode* head = node->tree->Split(node, k);
  policy_->Rescore(node);  // the rest starts at another page and depth
  for (const Replica& r : head->replicas) TrackExpiry(head, r);
  return head;
}

void CacheIndex::PinPath(RadixNode* node) {
  for (RadixNode* n = node; !n->is_root(); n = n->parent) {
    if (n->pin_count++ > 0) continue;
    const uint64_t bytes = NodeBytes(n);
    for (Replica& r : n->replicas) {
      budget_.Pin(r.pool, bytes);
      ledger_.Pin(*OwnerOf(n)->tenant, r.pool, bytes, true);
      RefreshCandidate(n, r);
    }
  }
}

void CacheIndex::UnpinPath(RadixNode* node) {
  for (RadixNode* n = node; !n->is_root();) {
    RadixNode* parent = n->parent;
    assert(n->pin_count > 0);
    if (--n->pin_count == 0) {
      const uint64_t bytes = NodeBytes(n);
      for (Replica& r : n->replicas) {
        budget_.Unpin(r.pool, bytes);
        ledger_.Pin(*OwnerOf(n)->tenant, r.pool, bytes, false);
        RefreshCandidate(n, r);
      }
      // A node an engine emptied while it was pinned (RemoveReplica) goes with its pin.
      if (n->replicas.empty() && n->children.empty()) n->tree->Remove(n);
    }
    n = parent;
  }
}

void CacheIndex::AddReplica(RadixNode* node, PoolId pool, std::span<const BlockId> block_ids,
                            int64_t committed_ms) {
  assert(block_ids.size() == node->size());
  node->replicas.push_back(
      Replica{.pool = pool,
              .committed_ms = committed_ms,
              .block_ids = std::vector<BlockId>(block_ids.begin(), block_ids.end())});
  TrackExpiry(node, node->replicas.back());
  const uint64_t bytes = NodeBytes(node);
  budget_.Charge(pool, node->size(), bytes);
  node->tree->AddPageLocations(node->size());
  if (node->pin_count > 0) budget_.Pin(pool, bytes);
  ledger_.Store(*OwnerOf(node)->tenant, pool, node->size(), bytes, node->pin_count > 0);
  if (!node->parent->is_root()) {
    Replica* up = node->parent->FindReplica(pool);
    assert(up != nullptr);  // pools are prefix-closed
    ++up->child_refs;
    RefreshCandidate(node->parent, *up);
  }
  RefreshCandidate(node, node->replicas.back());
  policy_->Rescore(node);  // scores may count replicas
}

void CacheIndex::Emit(CacheEvent::Kind kind, const Namespace& ns, PoolId pool,
                      std::span<const PageHash> pages, std::vector<BlockId> block_ids,
                      CacheEvent::Reason reason) {
  if (!listener_) return;
  listener_(CacheEvent{.kind = kind,
                       .ns = ns.id,
                       .pool = budget_.key(pool),
                       .pages = {pages.begin(), pages.end()},
                       .block_ids = std::move(block_ids),
                       .reason = reason});
}

void CacheIndex::EndPin(const Lease& lease) {
  --OwnerOf(lease.node)->tenant->pins;
  UnpinPath(lease.node);  // last: it may remove a node an engine emptied, lease.node too
}

void CacheIndex::ExpireLeasesLocked(absl::Time now) {
  leases_.Expire(now, [this](const Lease& lease) {
    EndPin(lease);
    ++counters_.lease_expiries;
  });
}

void CacheIndex::ExpireLeases() {
  WriterLock lock(this);
  ExpireLeasesLocked(clock_->Now());
}

void CacheIndex::ApplyAccessesLocked() {
  // A policy changes its order only here, with every reader out ("select" moving to another
  // candidate).
  policy_->Settle();
  // No reader holds mu_, so none records meanwhile and every node named is still there.
  thread_local std::vector<RecencyBuffer::Entry> pending;
  recency_.Take(pending);
  if (pending.empty()) return;
  thread_local std::vector<RadixNode*> path;
  for (const RecencyBuffer::Entry& a : pending) {
    // What the match would have done first and last, at its own time.
    ExpireLeasesLocked(a.at);
    if (options_.regret_window > absl::ZeroDuration()) ForgetOldEvictions(a.at);
    if (a.node == nullptr) continue;
    // Earlier accesses may have split the node: its end stays where it was, and the pages
    // split off went to new parents. Find the node holding the last matched page.
    path.clear();
    for (RadixNode* n = a.node; !n->is_root(); n = n->parent) path.push_back(n);
    uint32_t start = 0;
    for (const RadixNode* n : path) start += n->size();
    size_t last = 0;  // index in path (leaf first) of the node holding page end_page - 1
    start -= path[0]->size();
    while (start >= a.end_page) {
      ++last;
      start -= path[last]->size();
    }
    RadixNode* node = path[last];
    if (a.end_page < start + node->size()) node = SplitNode(node, a.end_page - start);
    // Root to leaf, as the match would have touched them.
    const double at_s = absl::ToDoubleSeconds(a.at - absl::UnixEpoch());
    path.clear();
    for (RadixNode* n = node; !n->is_root(); n = n->parent) path.push_back(n);
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      policy_->Touch(*it, a.stamp, at_s, Access::kMatch);
    }
  }
  pending.clear();  // names nodes that may go
}

void CacheIndex::FlushAccesses() { WriterLock lock(this); }

// A prompt for a policy that observes them (EvictionPolicy::OnPrompt), set under the index's
// lock and reported by the destructor, after the lock (declared later) is released: select's
// miniature simulations never lengthen a section of the index.
class CacheIndex::PromptObserver {
 public:
  explicit PromptObserver(const CacheIndex* index)
      : index_(index), wanted_(index->policy_->observes_prompts()) {}
  ~PromptObserver() {
    if (!ns_.has_value()) return;
    index_->policy_->OnPrompt(PromptEvent{.ns = *ns_,
                                          .spec = spec_,
                                          .bytes_per_page = bytes_per_page_,
                                          .pool = pool_,
                                          .pool_capacity_bytes = capacity_,
                                          .pages = pages_,
                                          .lookup = lookup_});
  }
  PromptObserver(const PromptObserver&) = delete;
  PromptObserver& operator=(const PromptObserver&) = delete;

  bool wanted() const { return wanted_; }

  // A lookup by, or a store into, GPU pool `pool` (other pools are not observed).
  void Set(const Namespace& ns, std::span<const PageHash> pages, PoolId pool, bool lookup)
      ABSL_SHARED_LOCKS_REQUIRED(index_->mu_) {
    const ByteBudget& budget = index_->budget_;
    if (!wanted_ || budget.retired(pool) || budget.engine(pool) ||
        budget.key(pool).tier != Tier::kGpu) {
      return;
    }
    ns_ = ns.id;
    spec_ = ns.spec;
    bytes_per_page_ = ns.bytes_per_page;
    pool_ = pool;
    capacity_ = budget.capacity(pool);
    pages_ = pages;
    lookup_ = lookup;
  }

 private:
  const CacheIndex* const index_;
  const bool wanted_;
  std::optional<NamespaceId> ns_;  // unset: nothing to report
  ModelSpec spec_;
  uint64_t bytes_per_page_ = 0;
  PoolId pool_ = 0;
  uint64_t capacity_ = 0;
  std::span<const PageHash> pages_;  // the caller's, alive until it returns
  bool lookup_ = false;
};

absl::StatusOr<MatchResult> CacheIndex::Match(const NamespaceId& ns_id,
                                              std::span<const PageHash> pages,
                                              const MatchOptions& options) {
  if (options.pin && options.probe) {
    return absl::InvalidArgumentError("probe matches cannot pin (set one of pin, probe)");
  }
  absl::Duration ttl;
  if (options.pin) {
    absl::StatusOr<absl::Duration> t = LeaseTtl(options.lease_ttl);
    if (!t.ok()) return t.status();
    ttl = *t;
  }

  PromptObserver observer(this);  // before the lock: it reports once the lock is released
  // Only a pinning match changes the tree at once; every other match shares the lock, and a
  // counting one records its recency update for the next exclusive section.
  const bool exclusive = options.pin;
  if (exclusive) {
    mu_.Lock();
    ApplyAccessesLocked();
  } else {
    mu_.ReaderLock();
  }
  struct Unlock {
    CacheIndex* index;
    bool shared;
    bool flush = false;  // too many accesses pending: apply them once unlocked
    ~Unlock() {
      shared ? index->mu_.ReaderUnlock() : index->mu_.Unlock();
      if (flush) index->FlushAccesses();
    }
  } unlock{this, !exclusive};

  const absl::Time now = clock_->Now();
  if (exclusive) ExpireLeasesLocked(now);
  absl::StatusOr<Namespace*> found = FindNamespace(ns_id);
  if (!found.ok()) return found.status();
  Namespace& ns = **found;
  Tenant& tenant = *ns.tenant;
  if (options.pin) {
    if (absl::Status s = ledger_.CheckPins(tenant); !s.ok()) return s;
  }

  thread_local std::vector<PathStep> path;
  MatchResult result;
  result.prompt_pages = static_cast<uint32_t>(pages.size());
  result.matched_pages = ns.tree.Walk(pages, &path);
  const int64_t cutoff_ms = ns.retention.CutoffMs(now);
  // Pages no pool holds (a pinned node an engine emptied), pages only dropped pools still
  // hold and pages past their age are gone: the match ends before the first. A node that
  // holds an expired copy ends it even when another pool holds the pages younger: pinning
  // the node would keep the old copy.
  const bool check_live = !sweeping_.empty() || cutoff_ms != INT64_MIN;
  for (size_t i = 0; i < path.size(); ++i) {
    const RadixNode* node = path[i].node;
    if (!node->replicas.empty() &&
        (!check_live || (HasLiveReplica(node) && !HoldsExpired(node, cutoff_ms)))) {
      continue;
    }
    result.matched_pages = path[i].first_page;
    path.resize(i);
    break;
  }

  if (options.pin && options_.tenant_max_pinned_bytes > 0) {
    // What the pin would add: the matched pages no pin holds yet, in every live pool.
    uint64_t adding = 0;
    for (const PathStep& step : path) {
      if (step.node->pin_count > 0) continue;
      for (const Replica& r : step.node->replicas) {
        if (!budget_.retired(r.pool) && !budget_.engine(r.pool)) {
          adding += uint64_t{step.matched} * ns.bytes_per_page;
        }
      }
    }
    if (absl::Status s = ledger_.CheckPinnedBytes(tenant, adding); !s.ok()) return s;
  }

  if (options.pin && ledger_.ShareApplies(tenant)) {
    // What the pin would add to the tenant's claim on each pool: the matched pages no pin
    // holds yet. A path has few replicas per node, so a short list beats a map.
    absl::InlinedVector<std::pair<PoolId, uint64_t>, 4> adding;
    for (const PathStep& step : path) {
      if (step.node->pin_count > 0) continue;
      for (const Replica& r : step.node->replicas) {
        if (budget_.retired(r.pool) || budget_.engine(r.pool)) continue;
        const uint64_t bytes = uint64_t{step.matched} * ns.bytes_per_page;
        auto it = std::find_if(adding.begin(), adding.end(),
                               [&](const auto& a) { return a.first == r.pool; });
        if (it == adding.end()) {
          adding.emplace_back(r.pool, bytes);
        } else {
          it->second += bytes;
        }
      }
    }
    for (const auto& [pool, bytes] : adding) {
      if (absl::Status s = ledger_.CheckShare(tenant, pool, bytes, "this pin"); !s.ok()) {
        return s;
      }
    }
  }

  if (!options.probe) {
    if (observer.wanted() && !options.requester_agent_id.empty()) {
      if (std::optional<PoolId> gpu =
              budget_.Find(PoolKey{options.requester_agent_id, Tier::kGpu})) {
        observer.Set(ns, pages, *gpu, /*lookup=*/true);
      }
    }
    if (exclusive) {
      // Split a partly matched last node so that stamps and pins cover exactly the match.
      if (!path.empty() && path.back().matched < path.back().node->size()) {
        path.back().node = SplitNode(path.back().node, path.back().matched);
      }
      const uint64_t stamp = recency_.NextStamp();
      const double now_s = absl::ToDoubleSeconds(now - absl::UnixEpoch());
      for (const PathStep& step : path) policy_->Touch(step.node, stamp, now_s, Access::kMatch);
      if (options_.regret_window > absl::ZeroDuration()) ForgetOldEvictions(now);
    } else {
      unlock.flush = recency_.Record(path.empty() ? nullptr : path.back().node,
                                     result.matched_pages, now) >= RecencyBuffer::kMaxPending;
    }
    const uint64_t page_tokens = ns.spec.page_size_tokens;
    constexpr auto kRelaxed = std::memory_order_relaxed;
    match_counters_.match_requests.fetch_add(1, kRelaxed);
    match_counters_.requested_pages.fetch_add(pages.size(), kRelaxed);
    match_counters_.matched_pages.fetch_add(result.matched_pages, kRelaxed);
    match_counters_.requested_tokens.fetch_add(page_tokens * pages.size(), kRelaxed);
    match_counters_.matched_tokens.fetch_add(page_tokens * result.matched_pages, kRelaxed);
    ns.requested_tokens.fetch_add(page_tokens * pages.size(), kRelaxed);
    ns.matched_tokens.fetch_add(page_tokens * result.matched_pages, kRelaxed);
    if (options_.regret_window > absl::ZeroDuration()) {
      CountRegret(pages.subspan(result.matched_pages), now);
    }
    if (options.pin && !path.empty()) {
      PinPath(path.back().node);
      result.lease_expiry = now + ttl;
      result.pin_id = leases_.Add(path.back().node, result.lease_expiry);
      ++tenant.pins;
      ++counters_.pins_taken;
    }
  }

  // Sized once: three allocations per match, whatever the number of replicas.
  size_t num_replicas = 0, num_block_ids = 0;
  for (const PathStep& step : path) {
    num_replicas += step.node->replicas.size();
    num_block_ids += step.node->replicas.size() * size_t{step.matched};
  }
  result.segments.reserve(path.size());
  result.replicas.reserve(num_replicas);
  result.block_ids.reserve(num_block_ids);
  const bool has_requester = !options.requester_agent_id.empty();
  bool local = has_requester;
  for (const PathStep& step : path) {
    MatchedSegment& seg = result.segments.emplace_back();
    seg.first_page = step.first_page;
    seg.num_pages = step.matched;
    seg.first_replica = static_cast<uint32_t>(result.replicas.size());
    bool held_here = false;
    for (const Replica& r : step.node->replicas) {
      if (budget_.retired(r.pool)) continue;
      MatchedReplica& out = result.replicas.emplace_back();
      out.pool = &budget_.key(r.pool);
      out.first_block = static_cast<uint32_t>(result.block_ids.size());
      result.block_ids.insert(result.block_ids.end(), r.block_ids.begin(),
                              r.block_ids.begin() + step.matched);
      if (has_requester && out.pool->agent_id == options.requester_agent_id) {
        // The requester's replicas first; the others keep index order.
        std::rotate(result.replicas.begin() + seg.first_replica, result.replicas.end() - 1,
                    result.replicas.end());
        held_here = true;
      }
    }
    seg.num_replicas = static_cast<uint32_t>(result.replicas.size()) - seg.first_replica;
    local = local && held_here;
    if (local) result.local_pages += step.matched;
  }
  return result;
}

absl::StatusOr<InsertResult> CacheIndex::Insert(const NamespaceId& ns_id,
                                                std::span<const PageHash> pages,
                                                const PoolKey& pool,
                                                std::span<const BlockId> block_ids,
                                                const InsertOptions& options) {
  if (pages.empty()) return absl::InvalidArgumentError("prompt has no whole page to insert");
  if (block_ids.size() != pages.size()) {
    return absl::InvalidArgumentError(absl::StrCat("block_ids has ", block_ids.size(),
                                                   " entries, expected ", pages.size(),
                                                   " (one per whole page)"));
  }
  if (pool.agent_id.empty()) return absl::InvalidArgumentError("pool.agent_id must be set");
  if (options.newly_committed.has_value() && options.newly_committed->size() != pages.size()) {
    return absl::InvalidArgumentError("newly_committed must have one entry per page");
  }

  PromptObserver observer(this);  // before the lock: it reports once the lock is released
  WriterLock lock(this);
  const absl::Time now = clock_->Now();
  ExpireLeasesLocked(now);
  absl::StatusOr<Namespace*> found = FindNamespace(ns_id);
  if (!found.ok()) return found.status();
  Namespace& ns = **found;
  // A page the pool holds already keeps its own commit time, even when it is past its
  // age (the sweep removes it, and the pages below it, soon).
  const int64_t committed_ms = absl::ToUnixMillis(
      options.committed_at.has_value() ? std::min(*options.committed_at, now) : now);

  std::optional<PoolId> pool_id = budget_.Find(pool);
  if (pool_id.has_value()) {
    if (absl::Status s = NotEnginePool(*pool_id, pool, "written by Insert"); !s.ok()) return s;
  }
  if (options.pool_generation.has_value() &&
      (!pool_id.has_value() || uint64_t{*pool_id} != *options.pool_generation)) {
    return absl::AbortedError(absl::StrCat("pool ", pool.ToString(),
                                           " was dropped while its agent committed the blocks "
                                           "(the agent's epoch ended, and its blocks with it)"));
  }
  if (!pool_id.has_value() && (options_.default_pool_capacity_bytes == 0 || !options.create_pool)) {
    return absl::NotFoundError(absl::StrCat(
        "pool ", pool.ToString(), " is not registered",
        options_.default_pool_capacity_bytes == 0
            ? ""
            : " (pools come from agents; only an admin's Insert creates an index-only pool)"));
  }

  // Phase 1, read-only: what is already there and what the new page-locations cost.
  thread_local std::vector<PathStep> path;
  const uint32_t n = static_cast<uint32_t>(pages.size());
  const uint32_t in_tree = ns.tree.Walk(pages, &path);
  uint32_t in_pool = 0;
  for (const PathStep& step : path) {
    if (!pool_id.has_value() || step.node->FindReplica(*pool_id) == nullptr) break;
    in_pool += step.matched;
  }
  if (options.newly_committed.has_value()) {
    for (uint32_t i = in_pool; i < n; ++i) {
      if ((*options.newly_committed)[i]) continue;
      return absl::FailedPreconditionError(
          absl::StrCat("block_ids[", i, "]: block ", block_ids[i],
                       " was committed to this page before, but "
                       "pool ",
                       pool.ToString(),
                       " no longer holds the page (it was evicted and the block "
                       "is being freed); allocate a new block"));
    }
  }
  const uint64_t need = uint64_t{n - in_pool} * ns.bytes_per_page;
  const uint64_t capacity =
      pool_id.has_value() ? budget_.capacity(*pool_id) : options_.default_pool_capacity_bytes;
  if (need > capacity) {
    return absl::ResourceExhaustedError(absl::StrCat("pool ", pool.ToString(), " has capacity ",
                                                     capacity, " bytes; the insert needs ", need));
  }

  InsertResult result;
  // Bytes the tenant reserved earlier in this pool stop being headroom and become the new
  // pages.
  Tenant& tenant = *ns.tenant;
  const uint64_t from_reserve =
      options.use_reservation ? std::min(need, ledger_.Reserved(tenant, pool)) : 0;
  const uint64_t adding = need - from_reserve;  // to the pool's and to the tenant's bytes
  const uint64_t shortfall = pool_id.has_value() ? budget_.Shortfall(*pool_id, adding) : 0;
  if (shortfall > 0 || ledger_.QuotaShortfall(tenant, adding) > 0) {
    // Pin the prompt's own path so eviction cannot take the pages being extended. Split a
    // partly matched last node first, so its unmatched rest stays evictable: an insert is
    // never refused while evictable bytes could cover it.
    if (!path.empty() && path.back().matched < path.back().node->size()) {
      path.back().node = SplitNode(path.back().node, path.back().matched);
    }
    RadixNode* guard = path.empty() ? nullptr : path.back().node;
    if (guard != nullptr) PinPath(guard);
    absl::StatusOr<uint64_t> evicted =
        MakeRoom(tenant, adding, pool_id, pool, shortfall, "the insert");
    if (guard != nullptr) UnpinPath(guard);
    if (!evicted.ok()) return evicted.status();
    result.evicted_bytes = *evicted;
  }
  if (from_reserve > 0) {
    budget_.Unreserve(*pool_id, from_reserve);
    ledger_.Unreserve(tenant, pool, from_reserve);
  }

  // Phase 2: apply.
  const PoolId pid =
      pool_id.has_value() ? *pool_id : budget_.Intern(pool, options_.default_pool_capacity_bytes);
  if (in_pool < n && !path.empty() && path.back().matched < path.back().node->size()) {
    path.back().node = SplitNode(path.back().node, path.back().matched);
  }
  RadixNode* parent = ns.tree.root();
  for (const PathStep& step : path) {
    if (const Replica* r = step.node->FindReplica(pid); r != nullptr) {
      result.existing_block_ids.insert(result.existing_block_ids.end(), r->block_ids.begin(),
                                       r->block_ids.begin() + step.matched);
    } else {
      AddReplica(step.node, pid, block_ids.subspan(step.first_page, step.matched), committed_ms);
    }
    parent = step.node;
  }
  if (in_tree < n) {
    RadixNode* leaf = ns.tree.AddChild(parent, pages.subspan(in_tree));
    const double added_s = absl::ToDoubleSeconds(now - absl::UnixEpoch());
    std::optional<EvictionPolicy::GhostHit> ghost_hit;
    if (std::optional<EvictionHistory::Run> ghost = history_.Take(pages[in_tree])) {
      // Back within the window: asked for again, on top of its earlier uses.
      leaf->hits = ghost->hits + 1;
      ghost_hit = EvictionPolicy::GhostHit{
          .hits = ghost->hits,
          .last_access_s = ghost->last_access_s,
          .evicted_s = absl::ToDoubleSeconds(ghost->at - absl::UnixEpoch()),
          .pages = ghost->pages,
          .tag = ghost->policy_tag};
      policy_->OnGhostHit(*leaf, *ghost_hit, added_s);
    }
    policy_->OnLeafAdded(*leaf, ghost_hit.has_value() ? &*ghost_hit : nullptr, added_s);
    AddReplica(leaf, pid, block_ids.subspan(in_tree), committed_ms);
    path.push_back(PathStep{leaf, in_tree, n - in_tree});
  }
  const uint64_t stamp = recency_.NextStamp();
  const double now_s = absl::ToDoubleSeconds(now - absl::UnixEpoch());
  for (const PathStep& step : path) policy_->Touch(step.node, stamp, now_s, Access::kInsert);

  result.already_present_pages = in_pool;
  result.replicated_pages = in_tree - in_pool;
  result.new_pages = n - in_tree;
  counters_.inserted_pages += n - in_pool;
  if (in_pool < n) Emit(CacheEvent::Kind::kStored, ns, pid, pages.subspan(in_pool));
  observer.Set(ns, pages, pid, /*lookup=*/false);
  return result;
}

absl::Status CacheIndex::Release(const NamespaceId& ns_id, PinId pin_id) {
  WriterLock lock(this);
  ExpireLeasesLocked(clock_->Now());
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_id);
  if (!ns.ok()) return ns.status();
  absl::StatusOr<Lease*> lease = leases_.Find(pin_id, &(*ns)->tree);
  if (!lease.ok()) return lease.status();
  EndPin(**lease);
  leases_.Erase(pin_id);
  ++counters_.pins_released;
  return absl::OkStatus();
}

absl::StatusOr<absl::Time> CacheIndex::RenewLease(const NamespaceId& ns_id, PinId pin_id,
                                                  absl::Duration ttl) {
  absl::StatusOr<absl::Duration> t = LeaseTtl(ttl);
  if (!t.ok()) return t.status();
  WriterLock lock(this);
  const absl::Time now = clock_->Now();
  ExpireLeasesLocked(now);
  absl::StatusOr<Namespace*> ns = FindNamespace(ns_id);
  if (!ns.ok()) return ns.status();
  absl::StatusOr<Lease*> lease = leases_.Find(pin_id, &(*ns)->tree);
  if (!lease.ok()) return lease.status();
  const int64_t cutoff_ms = (*ns)->retention.CutoffMs(now);
  for (const RadixNode* node = (*lease)->node; !node->is_root(); node = node->parent) {
    if (!HasLiveReplica(node)) {
      return absl::AbortedError(
          absl::StrCat("pin ", pin_id,
                       ": some of its pages are no longer held by any live pool (the agent "
                       "holding them went away); release the pin and match again"));
    }
    if (HoldsExpired(node, cutoff_ms)) {
      return absl::AbortedError(absl::StrCat(
          "pin ", pin_id,
          ": some of its pages are past the namespace's max page age and leave when the pin "
          "ends; release the pin and match again"));
    }
  }
  leases_.SetExpiry(*lease, now + *t);
  return now + *t;
}

IndexStats CacheIndex::Stats() const {
  IndexStats stats;
  // Outside the lock: select reads its miniature indexes under a lock of its own, and a
  // scrape must not hold the index's writers up meanwhile.
  stats.selection = policy_->selection();
  absl::ReaderMutexLock lock(&mu_);
  stats.pools.reserve(budget_.size());
  const bool share = ledger_.ShareInForce();
  for (PoolId id = 0; id < budget_.size(); ++id) {
    if (budget_.retired(id)) continue;
    stats.pools.push_back(budget_.stats(id));
    if (share && !budget_.engine(id)) stats.pools.back().tenant_share_bytes = ledger_.ShareCap(id);
  }
  stats.namespaces.reserve(namespaces_.size());
  for (const auto& [id, ns] : namespaces_) {
    stats.namespaces.push_back(NamespaceStats{
        .ns = id,
        .spec = ns->spec,
        .pages = ns->tree.pages(),
        .page_locations = ns->tree.page_locations(),
        .radix_nodes = ns->tree.nodes(),
        .max_page_age = ns->retention.limited() ? ns->retention.max_age() : absl::ZeroDuration(),
        .expired_pages = ns->expired_pages,
        .requested_tokens = ns->requested_tokens.load(std::memory_order_relaxed),
        .matched_tokens = ns->matched_tokens.load(std::memory_order_relaxed)});
  }
  std::sort(stats.namespaces.begin(), stats.namespaces.end(), [](const auto& a, const auto& b) {
    return std::tie(a.ns.tenant, a.ns.model) < std::tie(b.ns.tenant, b.ns.model);
  });
  stats.tenants.reserve(ledger_.size());
  ledger_.ForEach([&](const Tenant& t) {
    stats.tenants.push_back(TenantStats{.tenant = t.name,
                                        .namespaces = t.namespaces,
                                        .stored_bytes = t.stored_bytes,
                                        .pinned_bytes = t.pinned_bytes,
                                        .reserved_bytes = t.reserved_bytes,
                                        .pins = t.pins,
                                        .engine_pages = t.engine_pages});
  });
  std::sort(stats.tenants.begin(), stats.tenants.end(),
            [](const auto& a, const auto& b) { return a.tenant < b.tenant; });
  stats.tenant_max_bytes = options_.tenant_max_bytes;
  stats.tenant_max_pinned_bytes = options_.tenant_max_pinned_bytes;
  stats.default_tenant_pool_share_pct = share ? options_.default_tenant_pool_share_pct : 0;
  stats.max_engine_pages_per_engine = options_.max_engine_pages_per_engine;
  stats.max_engine_pages_per_tenant = options_.max_engine_pages_per_tenant;
  stats.counters = counters_;
  constexpr auto kRelaxed = std::memory_order_relaxed;
  stats.counters.match_requests = match_counters_.match_requests.load(kRelaxed);
  stats.counters.requested_pages = match_counters_.requested_pages.load(kRelaxed);
  stats.counters.matched_pages = match_counters_.matched_pages.load(kRelaxed);
  stats.counters.requested_tokens = match_counters_.requested_tokens.load(kRelaxed);
  stats.counters.matched_tokens = match_counters_.matched_tokens.load(kRelaxed);
  stats.counters.eviction_regret_pages = match_counters_.eviction_regret_pages.load(kRelaxed);
  stats.active_pins = leases_.size();
  stats.policy = std::string(policy_->name());
  return stats;
}

}  // namespace kvcm
