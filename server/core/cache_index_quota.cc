// CacheIndex: tenant quotas. The counts and checks are TenantLedger's (tenant_ledger.h);
// here is what needs the tree too: evicting a tenant's own pages to make room, Reserve and
// Unreserve, and the audit of the ledger against the trees. See docs/EVICTION.md ("Tenant
// quotas").
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

void CacheIndex::SetConfiguredTenants(size_t count) {
  WriterLock lock(this);
  ledger_.set_configured_tenants(count);
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
  if (ledger_.QuotaShortfall(tenant, adding) > tenant.evictable()) {
    return ledger_.QuotaExhausted(tenant, adding, what);
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
  if (const uint64_t over = ledger_.QuotaShortfall(tenant, adding); over > 0) {
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
  Tenant& tenant = ledger_.Intern(tenant_name);
  if (absl::Status s = ledger_.CheckShare(tenant, *id, bytes, "the reservation"); !s.ok()) {
    ledger_.MaybeForget(tenant);
    return s;
  }
  absl::StatusOr<uint64_t> evicted =
      MakeRoom(tenant, bytes, *id, pool, budget_.Shortfall(*id, bytes), "the reservation");
  if (!evicted.ok()) {
    ledger_.MaybeForget(tenant);
    return evicted.status();
  }
  budget_.Reserve(*id, bytes);
  ledger_.Reserve(tenant, pool, bytes);
  return *evicted;
}

absl::Status CacheIndex::Unreserve(const PoolKey& pool, uint64_t bytes,
                                   const std::string& tenant_name) {
  WriterLock lock(this);
  absl::StatusOr<PoolId> id = FindPool(pool);
  if (!id.ok()) return id.status();
  Tenant* tenant = ledger_.Find(tenant_name);
  const uint64_t held = tenant == nullptr ? 0 : ledger_.Reserved(*tenant, pool);
  if (bytes > held) {
    return absl::OutOfRangeError(absl::StrCat("bytes ", bytes, " exceeds the ", held, " bytes ",
                                              Owner(tenant_name), " reserved in pool ",
                                              pool.ToString()));
  }
  if (bytes == 0) return absl::OkStatus();
  budget_.Unreserve(*id, bytes);
  ledger_.Unreserve(*tenant, pool, bytes);
  ledger_.MaybeForget(*tenant);
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
    if (ledger_.Find(id.tenant) != ns->tenant || ns->tenant == nullptr) {
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
  std::vector<const Tenant*> records;
  ledger_.ForEach([&](const Tenant& t) { records.push_back(&t); });
  for (const Tenant* tenant : records) {
    const std::string& name = tenant->name;
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
  if (want.size() > ledger_.size()) {
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
