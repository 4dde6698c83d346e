// CacheIndex: tenant quotas. Every tenant's stored, pinned and reserved bytes are counted
// as replicas enter and leave the tree, as paths are pinned and unpinned and as pools are
// dropped, so that tenant_max_bytes (Insert, Reserve), tenant_max_pinned_bytes (Match) and
// the per-tenant reservations are checked in O(1). See cache_index.h and docs/EVICTION.md
// ("Tenant quotas").
#include <algorithm>
#include <cassert>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/core/cache_index.h"
#include "server/core/cache_index_internal.h"

namespace kvcm {

namespace {

// How a message names the owner of a reservation.
std::string Owner(const std::string& tenant) {
  return tenant.empty() ? "the operators (tenant \"\")" : absl::StrCat("tenant ", tenant);
}

}  // namespace

CacheIndex::Tenant& CacheIndex::InternTenant(const std::string& name) {
  auto [it, inserted] = tenants_.try_emplace(name);
  if (inserted) it->second = std::make_unique<Tenant>(name, next_tenant_group_++);
  return *it->second;
}

void CacheIndex::MaybeForgetTenant(Tenant& tenant) {
  if (tenant.namespaces > 0 || tenant.reserved_bytes > 0) return;
  assert(tenant.pins == 0 && tenant.stored_bytes == 0 && tenant.by_pool.empty());
  const std::string name = tenant.name;  // the record goes with the erase
  tenants_.erase(name);
}

void CacheIndex::TenantStore(const RadixNode* node, PoolId pool) {
  if (budget_.engine(pool)) {
    // The engines' memory, not kvcm's: counted in pages, until the index lets them go.
    OwnerOf(node)->tenant->engine_pages += node->size();
    return;
  }
  // Retired pools count for no one.
  if (budget_.retired(pool)) return;
  Tenant& tenant = *OwnerOf(node)->tenant;
  const uint64_t bytes = NodeBytes(node);
  Tenant::PoolUse& use = tenant.by_pool[pool];
  use.stored += bytes;
  tenant.stored_bytes += bytes;
  if (node->pin_count > 0) {
    use.pinned += bytes;
    tenant.pinned_bytes += bytes;
  }
}

void CacheIndex::TenantUnstore(const RadixNode* node, PoolId pool) {
  if (budget_.engine(pool)) {
    assert(OwnerOf(node)->tenant->engine_pages >= node->size());
    OwnerOf(node)->tenant->engine_pages -= node->size();
    return;
  }
  // Retired pools count for no one.
  if (budget_.retired(pool)) return;
  Tenant& tenant = *OwnerOf(node)->tenant;
  const uint64_t bytes = NodeBytes(node);
  auto it = tenant.by_pool.find(pool);
  assert(it != tenant.by_pool.end() && it->second.stored >= bytes);
  it->second.stored -= bytes;
  tenant.stored_bytes -= bytes;
  if (node->pin_count > 0) {
    it->second.pinned -= bytes;
    tenant.pinned_bytes -= bytes;
  }
  if (it->second.stored == 0) tenant.by_pool.erase(it);
}

void CacheIndex::TenantPin(const RadixNode* node, PoolId pool, bool pinned) {
  // Retired pools count for no one; engine pools are the engines' memory, not kvcm's.
  if (budget_.retired(pool) || budget_.engine(pool)) return;
  Tenant& tenant = *OwnerOf(node)->tenant;
  const uint64_t bytes = NodeBytes(node);
  auto it = tenant.by_pool.find(pool);
  assert(it != tenant.by_pool.end());
  if (pinned) {
    it->second.pinned += bytes;
    tenant.pinned_bytes += bytes;
  } else {
    it->second.pinned -= bytes;
    tenant.pinned_bytes -= bytes;
  }
}

void CacheIndex::TenantDropPool(PoolId pool) {
  // O(tenants): a pool is dropped when its agent restarts or goes away, not per request.
  for (auto& [name, tenant] : tenants_) {
    auto it = tenant->by_pool.find(pool);
    if (it == tenant->by_pool.end()) continue;
    tenant->stored_bytes -= it->second.stored;
    tenant->pinned_bytes -= it->second.pinned;
    tenant->by_pool.erase(it);
  }
}

uint64_t CacheIndex::QuotaShortfall(const Tenant& tenant, uint64_t adding) const {
  if (options_.tenant_max_bytes == 0 || tenant.name.empty()) return 0;
  const uint64_t after = tenant.stored_bytes + tenant.reserved_bytes + adding;
  return after > options_.tenant_max_bytes ? after - options_.tenant_max_bytes : 0;
}

absl::Status CacheIndex::QuotaExhausted(const Tenant& tenant, uint64_t adding,
                                        absl::string_view what) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant_max_bytes: tenant ", tenant.name, " holds ",
      tenant.stored_bytes + tenant.reserved_bytes, " of its ", options_.tenant_max_bytes,
      " bytes (", tenant.stored_bytes, " of pages, ", tenant.pinned_bytes, " of them pinned, and ",
      tenant.reserved_bytes, " reserved); ", what, " needs ", adding, " more and only ",
      tenant.evictable(), " of its bytes are evictable (nothing changed)"));
}

bool CacheIndex::ShareApplies(const Tenant& tenant) const {
  return options_.default_tenant_pool_share_pct < 100 && options_.tenant_max_bytes == 0 &&
         options_.tenant_max_pinned_bytes == 0 && !tenant.name.empty();
}

uint64_t CacheIndex::ShareCap(PoolId pool) const {
  // capacity x pct / 100 without overflowing for capacities near 2^64.
  const uint64_t capacity = budget_.capacity(pool);
  const uint64_t pct = options_.default_tenant_pool_share_pct;
  return capacity / 100 * pct + capacity % 100 * pct / 100;
}

uint64_t CacheIndex::ShareClaim(const Tenant& tenant, PoolId pool) const {
  uint64_t claim = 0;
  if (auto it = tenant.by_pool.find(pool); it != tenant.by_pool.end()) claim += it->second.pinned;
  if (auto it = tenant.reserved.find(budget_.key(pool)); it != tenant.reserved.end()) {
    claim += it->second;
  }
  return claim;
}

void CacheIndex::SetConfiguredTenants(size_t count) {
  WriterLock lock(this);
  configured_tenants_ = count;
}

bool CacheIndex::SharedWithOthers(const Tenant& tenant, PoolId pool) const {
  // Known tenants that have not arrived yet are owed their share from the first byte: the
  // first tenant must not take a pool the next one then finds full of its reservations.
  if (configured_tenants_ > 1) return true;
  // The pool's used and reserved bytes, less the tenant's own and the operators'
  // reservations: what is left is other tenants' pages and reservations.
  // (The counts agree, CheckTenantAccounting says; the sum is compared, not subtracted, so
  // that a disagreement could never wrap around.)
  uint64_t own = 0;
  if (auto it = tenant.by_pool.find(pool); it != tenant.by_pool.end()) own += it->second.stored;
  const PoolKey& key = budget_.key(pool);
  if (auto it = tenant.reserved.find(key); it != tenant.reserved.end()) own += it->second;
  if (auto ops = tenants_.find(""); ops != tenants_.end()) {
    if (auto it = ops->second->reserved.find(key); it != ops->second->reserved.end()) {
      own += it->second;
    }
  }
  return budget_.used(pool) + budget_.reserved(pool) > own;
}

absl::Status CacheIndex::CheckShare(const Tenant& tenant, PoolId pool, uint64_t adding,
                                    absl::string_view what) const {
  if (!ShareApplies(tenant) || !SharedWithOthers(tenant, pool)) return absl::OkStatus();
  const uint64_t claim = ShareClaim(tenant, pool);
  const uint64_t cap = ShareCap(pool);
  if (claim <= cap && adding <= cap - claim) return absl::OkStatus();
  uint64_t reserved = 0;
  if (auto it = tenant.reserved.find(budget_.key(pool)); it != tenant.reserved.end()) {
    reserved = it->second;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "default_tenant_pool_share_pct: tenant ", tenant.name, " may reserve and pin at most ",
      options_.default_tenant_pool_share_pct, "% (", cap, " bytes) of pool ",
      budget_.key(pool).ToString(), " and holds ", claim, " (", reserved, " reserved, ",
      claim - reserved, " pinned); ", what, " would add ", adding,
      configured_tenants_ > 1
          ? absl::StrCat(" while ", configured_tenants_, " tenants are configured")
          : std::string(" while other tenants use the pool"),
      " (nothing changed; an operator may set tenant quotas instead)"));
}

EvictResult CacheIndex::EvictTenantLocked(Tenant& tenant, uint64_t bytes) {
  EvictResult result;
  const absl::Time now = clock_->Now();
  while (result.evicted_bytes < bytes) {
    std::optional<EvictionCandidate> victim = policy_->GroupVictim(tenant.group);
    if (!victim.has_value()) break;
    RadixNode* node = victim->node;
    if (budget_.retired(victim->pool)) {
      // A dropped pool's replica counts for no one: sweep it, as SweepRetired would.
      RemoveReplica(node, victim->pool, [](RadixNode*) {});
      continue;
    }
    if (policy_->trims_nodes()) {
      // Evict only the tail pages still needed, as EvictLocked does.
      const uint64_t page_bytes = node->tree->bytes_per_page();
      const uint64_t pages_needed = (bytes - result.evicted_bytes + page_bytes - 1) / page_bytes;
      if (pages_needed < node->size()) {
        SplitNode(node, node->size() - static_cast<uint32_t>(pages_needed));
      }
    }
    // Never demoted: a copy in the HOST pool would still be the tenant's.
    result.evicted_pages += node->size();
    result.evicted_bytes += EvictReplica(node, victim->pool, now);
  }
  return result;
}

absl::StatusOr<uint64_t> CacheIndex::MakeRoom(Tenant& tenant, uint64_t adding,
                                              std::optional<PoolId> pool, const PoolKey& pool_key,
                                              uint64_t pool_shortfall, absl::string_view what) {
  // Both checks first, so that a refused call evicts nothing.
  if (QuotaShortfall(tenant, adding) > tenant.evictable()) {
    return QuotaExhausted(tenant, adding, what);
  }
  if (pool_shortfall > 0 && budget_.evictable(*pool) < pool_shortfall) {
    // Say what holds the space: pins, headroom reserved for admitted work, or both.
    return absl::ResourceExhaustedError(absl::StrCat(
        "pool ", pool_key.ToString(), " is short of ", pool_shortfall, " bytes for ", what,
        " and only ", budget_.evictable(*pool), " are evictable (", budget_.pinned(*pool),
        " bytes pinned, ", budget_.reserved(*pool), " reserved by Reserve)"));
  }
  uint64_t evicted = 0;
  if (pool_shortfall > 0) {
    evicted += EvictLocked(*pool, pool_shortfall, Incoming{&tenant, adding}).evicted_bytes;
  }
  // The pool's victims may have been the tenant's own pages, and a demotion of one never
  // takes it past the quota (DemoteToHost leaves room for `adding`): what is still over is
  // at most what is still evictable.
  if (const uint64_t over = QuotaShortfall(tenant, adding); over > 0) {
    assert(tenant.evictable() >= over);
    evicted += EvictTenantLocked(tenant, over).evicted_bytes;
  }
  return evicted;
}

absl::StatusOr<uint64_t> CacheIndex::Reserve(const PoolKey& pool, uint64_t bytes,
                                             const std::string& tenant_name) {
  if (bytes == 0) return absl::InvalidArgumentError("bytes must be > 0");
  WriterLock lock(this);
  ExpireLeasesLocked(clock_->Now());
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();
  if (absl::Status s = NotEnginePool(*id, pool, "reserved"); !s.ok()) return s;
  Tenant& tenant = InternTenant(tenant_name);
  if (absl::Status s = CheckShare(tenant, *id, bytes, "the reservation"); !s.ok()) {
    MaybeForgetTenant(tenant);
    return s;
  }
  absl::StatusOr<uint64_t> evicted =
      MakeRoom(tenant, bytes, *id, pool, budget_.Shortfall(*id, bytes), "the reservation");
  if (!evicted.ok()) {
    MaybeForgetTenant(tenant);
    return evicted.status();
  }
  budget_.Reserve(*id, bytes);
  tenant.reserved_bytes += bytes;
  tenant.reserved[pool] += bytes;
  return *evicted;
}

absl::Status CacheIndex::Unreserve(const PoolKey& pool, uint64_t bytes,
                                   const std::string& tenant_name) {
  WriterLock lock(this);
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();
  Tenant* tenant = nullptr;
  uint64_t held = 0;
  if (auto t = tenants_.find(tenant_name); t != tenants_.end()) {
    tenant = t->second.get();
    if (auto r = tenant->reserved.find(pool); r != tenant->reserved.end()) held = r->second;
  }
  if (bytes > held) {
    return absl::OutOfRangeError(absl::StrCat("bytes ", bytes, " exceeds the ", held, " bytes ",
                                              Owner(tenant_name), " reserved in pool ",
                                              pool.ToString()));
  }
  if (bytes == 0) return absl::OkStatus();
  budget_.Unreserve(*id, bytes);
  tenant->reserved_bytes -= bytes;
  auto reservation = tenant->reserved.find(pool);
  if ((reservation->second -= bytes) == 0) tenant->reserved.erase(reservation);
  MaybeForgetTenant(*tenant);
  return absl::OkStatus();
}

absl::Status CacheIndex::CheckTenantAccounting() const {
  absl::ReaderMutexLock lock(&mu_);
  struct Usage {
    uint32_t namespaces = 0;
    uint32_t pins = 0;
    uint64_t stored = 0;
    uint64_t pinned = 0;
    uint64_t engine_pages = 0;
    absl::flat_hash_map<PoolId, Tenant::PoolUse> by_pool;
  };
  absl::flat_hash_map<std::string, Usage> want;
  for (const auto& [id, ns] : namespaces_) {
    auto record = tenants_.find(id.tenant);
    if (record == tenants_.end() || record->second.get() != ns->tenant) {
      return absl::InternalError(
          absl::StrCat("namespace ", id.ToString(), " has no tenant record"));
    }
    if (ns->tree.group() != ns->tenant->group) {
      return absl::InternalError(absl::StrCat("namespace ", id.ToString(), " has the wrong group"));
    }
    Usage& u = want[id.tenant];
    ++u.namespaces;
    std::vector<const RadixNode*> stack;
    ns->tree.root()->children.ForEach([&](const RadixNode* child) { stack.push_back(child); });
    while (!stack.empty()) {
      const RadixNode* node = stack.back();
      stack.pop_back();
      for (const Replica& r : node->replicas) {
        if (budget_.engine(r.pool)) u.engine_pages += node->size();
        if (budget_.retired(r.pool) || budget_.engine(r.pool)) continue;
        const uint64_t bytes = NodeBytes(node);
        u.stored += bytes;
        u.by_pool[r.pool].stored += bytes;
        if (node->pin_count > 0) {
          u.pinned += bytes;
          u.by_pool[r.pool].pinned += bytes;
        }
      }
      node->children.ForEach([&](const RadixNode* child) { stack.push_back(child); });
    }
  }
  size_t pins = 0;
  leases_.ForEach([&](const Lease& lease) {
    ++want[OwnerOf(lease.node)->id.tenant].pins;
    ++pins;
  });
  // Reservations: each live pool's count is the sum of its tenants'.
  absl::flat_hash_map<PoolKey, uint64_t> reserved;
  for (const auto& [name, tenant] : tenants_) {
    uint64_t total = 0;
    for (const auto& [pool, bytes] : tenant->reserved) {
      if (bytes == 0) return absl::InternalError(absl::StrCat(Owner(name), ": zero reservation"));
      total += bytes;
      reserved[pool] += bytes;
    }
    if (total != tenant->reserved_bytes) {
      return absl::InternalError(absl::StrCat(
          Owner(name), " reserved_bytes ", tenant->reserved_bytes, ", its pools sum to ", total));
    }
    const Usage& u = want[name];
    if (tenant->namespaces != u.namespaces || tenant->pins != u.pins ||
        tenant->stored_bytes != u.stored || tenant->pinned_bytes != u.pinned) {
      return absl::InternalError(absl::StrCat(
          Owner(name), " counts namespaces/pins/stored/pinned ", tenant->namespaces, "/",
          tenant->pins, "/", tenant->stored_bytes, "/", tenant->pinned_bytes, ", the index holds ",
          u.namespaces, "/", u.pins, "/", u.stored, "/", u.pinned));
    }
    if (tenant->engine_pages != u.engine_pages) {
      return absl::InternalError(absl::StrCat(Owner(name), " counts ", tenant->engine_pages,
                                              " engine pages, the index holds ", u.engine_pages));
    }
    if (tenant->by_pool.size() != u.by_pool.size()) {
      return absl::InternalError(absl::StrCat(Owner(name), " counts ", tenant->by_pool.size(),
                                              " pools, the index holds ", u.by_pool.size()));
    }
    for (const auto& [pool, use] : u.by_pool) {
      auto it = tenant->by_pool.find(pool);
      if (it == tenant->by_pool.end() || it->second.stored != use.stored ||
          it->second.pinned != use.pinned) {
        return absl::InternalError(
            absl::StrCat(Owner(name), ": wrong usage of pool ", budget_.key(pool).ToString()));
      }
    }
    if (tenant->namespaces == 0 && tenant->reserved_bytes == 0) {
      return absl::InternalError(absl::StrCat(Owner(name), " has a record and nothing else"));
    }
  }
  if (want.size() > tenants_.size()) {
    return absl::InternalError("a tenant with namespaces or pins has no record");
  }
  if (pins != leases_.size()) return absl::InternalError("pins of unknown tenants");
  for (PoolId id = 0; id < budget_.size(); ++id) {
    const uint64_t expected = budget_.retired(id) ? 0 : reserved[budget_.key(id)];
    if (budget_.reserved(id) != expected) {
      return absl::InternalError(absl::StrCat("pool ", budget_.key(id).ToString(), " reserves ",
                                              budget_.reserved(id), ", its tenants ", expected));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcm
