#include "server/core/tenant_ledger.h"

#include <cassert>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvcm {

Tenant& TenantLedger::Intern(const std::string& name) {
  auto [it, inserted] = tenants_.try_emplace(name);
  if (inserted) it->second = std::make_unique<Tenant>(name, next_group_++);
  return *it->second;
}

Tenant* TenantLedger::Find(const std::string& name) {
  auto it = tenants_.find(name);
  return it == tenants_.end() ? nullptr : it->second.get();
}

const Tenant* TenantLedger::Find(const std::string& name) const {
  auto it = tenants_.find(name);
  return it == tenants_.end() ? nullptr : it->second.get();
}

void TenantLedger::MaybeForget(Tenant& tenant) {
  if (tenant.namespaces > 0 || tenant.reserved_bytes > 0) return;
  assert(tenant.pins == 0 && tenant.stored_bytes == 0 && tenant.by_pool.empty());
  const std::string name = tenant.name;  // the record goes with the erase
  tenants_.erase(name);
}

void TenantLedger::ForEach(absl::FunctionRef<void(const Tenant&)> fn) const {
  for (const auto& [name, tenant] : tenants_) fn(*tenant);
}

void TenantLedger::Store(Tenant& tenant, PoolId pool, uint64_t pages, uint64_t bytes, bool pinned) {
  if (budget_.engine(pool)) {
    // The engines' memory, not kvcm's: counted in pages, until the index lets them go.
    tenant.engine_pages += pages;
    return;
  }
  if (budget_.retired(pool)) return;
  Tenant::PoolUse& use = tenant.by_pool[pool];
  use.stored += bytes;
  tenant.stored_bytes += bytes;
  if (pinned) {
    use.pinned += bytes;
    tenant.pinned_bytes += bytes;
  }
}

void TenantLedger::Unstore(Tenant& tenant, PoolId pool, uint64_t pages, uint64_t bytes,
                           bool pinned) {
  if (budget_.engine(pool)) {
    assert(tenant.engine_pages >= pages);
    tenant.engine_pages -= pages;
    return;
  }
  if (budget_.retired(pool)) return;
  auto it = tenant.by_pool.find(pool);
  assert(it != tenant.by_pool.end() && it->second.stored >= bytes);
  it->second.stored -= bytes;
  tenant.stored_bytes -= bytes;
  if (pinned) {
    it->second.pinned -= bytes;
    tenant.pinned_bytes -= bytes;
  }
  if (it->second.stored == 0) tenant.by_pool.erase(it);
}

void TenantLedger::Pin(Tenant& tenant, PoolId pool, uint64_t bytes, bool pinned) {
  // Retired pools count for no one; engine pools are the engines' memory, not kvcm's.
  if (budget_.retired(pool) || budget_.engine(pool)) return;
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

void TenantLedger::DropPool(PoolId pool) {
  // O(tenants): a pool is dropped when its agent restarts or goes away, not per request.
  for (auto& [name, tenant] : tenants_) {
    auto it = tenant->by_pool.find(pool);
    if (it == tenant->by_pool.end()) continue;
    tenant->stored_bytes -= it->second.stored;
    tenant->pinned_bytes -= it->second.pinned;
    tenant->by_pool.erase(it);
  }
}

uint64_t TenantLedger::Reserved(const Tenant& tenant, const PoolKey& pool) const {
  auto it = tenant.reserved.find(pool);
  return it == tenant.reserved.end() ? 0 : it->second;
}

void TenantLedger::Reserve(Tenant& tenant, const PoolKey& pool, uint64_t bytes) {
  tenant.reserved_bytes += bytes;
  tenant.reserved[pool] += bytes;
}

void TenantLedger::Unreserve(Tenant& tenant, const PoolKey& pool, uint64_t bytes) {
  if (bytes == 0) return;
  auto it = tenant.reserved.find(pool);
  assert(it != tenant.reserved.end() && it->second >= bytes);
  tenant.reserved_bytes -= bytes;
  if ((it->second -= bytes) == 0) tenant.reserved.erase(it);
}

void TenantLedger::ReleasePool(const PoolKey& pool) {
  std::vector<Tenant*> released;
  for (auto& [name, tenant] : tenants_) {
    auto it = tenant->reserved.find(pool);
    if (it == tenant->reserved.end()) continue;
    tenant->reserved_bytes -= it->second;
    tenant->reserved.erase(it);
    released.push_back(tenant.get());
  }
  for (Tenant* tenant : released) MaybeForget(*tenant);
}

absl::Status TenantLedger::CheckPins(const Tenant& tenant) const {
  if (tenant.pins < quotas_.max_pins) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("max_pins_per_tenant: tenant ", tenant.name, " holds ", tenant.pins,
                   " live pins; release some (nothing was matched or pinned)"));
}

absl::Status TenantLedger::CheckPinnedBytes(const Tenant& tenant, uint64_t adding) const {
  if (quotas_.max_pinned_bytes == 0 || tenant.pinned_bytes + adding <= quotas_.max_pinned_bytes) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant_max_pinned_bytes: tenant ", tenant.name, " has ", tenant.pinned_bytes,
      " bytes pinned (", tenant.pins, " pins) of its ", quotas_.max_pinned_bytes,
      "; this pin would add ", adding, "; release some (nothing was matched or pinned)"));
}

uint64_t TenantLedger::QuotaShortfall(const Tenant& tenant, uint64_t adding) const {
  if (quotas_.max_bytes == 0 || tenant.name.empty()) return 0;
  const uint64_t after = tenant.stored_bytes + tenant.reserved_bytes + adding;
  return after > quotas_.max_bytes ? after - quotas_.max_bytes : 0;
}

absl::Status TenantLedger::QuotaExhausted(const Tenant& tenant, uint64_t adding,
                                          absl::string_view what) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant_max_bytes: tenant ", tenant.name, " holds ",
      tenant.stored_bytes + tenant.reserved_bytes, " of its ", quotas_.max_bytes, " bytes (",
      tenant.stored_bytes, " of pages, ", tenant.pinned_bytes, " of them pinned, and ",
      tenant.reserved_bytes, " reserved); ", what, " needs ", adding, " more and only ",
      tenant.evictable(), " of its bytes are evictable (nothing changed)"));
}

bool TenantLedger::ShareInForce() const {
  return quotas_.pool_share_pct < 100 && quotas_.max_bytes == 0 && quotas_.max_pinned_bytes == 0;
}

bool TenantLedger::ShareApplies(const Tenant& tenant) const {
  return ShareInForce() && !tenant.name.empty();
}

uint64_t TenantLedger::ShareCap(PoolId pool) const {
  // capacity x pct / 100 without overflowing for capacities near 2^64.
  const uint64_t capacity = budget_.capacity(pool);
  const uint64_t pct = quotas_.pool_share_pct;
  return capacity / 100 * pct + capacity % 100 * pct / 100;
}

uint64_t TenantLedger::ShareClaim(const Tenant& tenant, PoolId pool) const {
  uint64_t claim = 0;
  if (auto it = tenant.by_pool.find(pool); it != tenant.by_pool.end()) claim += it->second.pinned;
  return claim + Reserved(tenant, budget_.key(pool));
}

bool TenantLedger::SharedWithOthers(const Tenant& tenant, PoolId pool) const {
  // Known tenants that have not arrived yet are owed their share from the first byte: the
  // first tenant must not take a pool the next one then finds full of its reservations.
  if (configured_tenants_ > 1) return true;
  // The pool's used and reserved bytes, less the tenant's own and the operators'
  // reservations: what is left is other tenants' pages and reservations.
  // (The counts agree, CacheIndex::CheckTenantAccounting says; the sum is compared, not
  // subtracted, so that a disagreement could never wrap around.)
  uint64_t own = 0;
  if (auto it = tenant.by_pool.find(pool); it != tenant.by_pool.end()) own += it->second.stored;
  const PoolKey& key = budget_.key(pool);
  own += Reserved(tenant, key);
  if (const Tenant* ops = Find(""); ops != nullptr) own += Reserved(*ops, key);
  return budget_.used(pool) + budget_.reserved(pool) > own;
}

absl::Status TenantLedger::CheckShare(const Tenant& tenant, PoolId pool, uint64_t adding,
                                      absl::string_view what) const {
  if (!ShareApplies(tenant) || !SharedWithOthers(tenant, pool)) return absl::OkStatus();
  const uint64_t claim = ShareClaim(tenant, pool);
  const uint64_t cap = ShareCap(pool);
  if (claim <= cap && adding <= cap - claim) return absl::OkStatus();
  const uint64_t reserved = Reserved(tenant, budget_.key(pool));
  return absl::ResourceExhaustedError(absl::StrCat(
      "default_tenant_pool_share_pct: tenant ", tenant.name, " may reserve and pin at most ",
      quotas_.pool_share_pct, "% (", cap, " bytes) of pool ", budget_.key(pool).ToString(),
      " and holds ", claim, " (", reserved, " reserved, ", claim - reserved, " pinned); ", what,
      " would add ", adding,
      configured_tenants_ > 1
          ? absl::StrCat(" while ", configured_tenants_, " tenants are configured")
          : std::string(" while other tenants use the pool"),
      " (nothing changed; an operator may set tenant quotas instead)"));
}

}  // namespace kvcm
