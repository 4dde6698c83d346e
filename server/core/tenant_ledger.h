// TenantLedger: what each tenant holds (namespaces, pins, stored, pinned and reserved bytes,
// engine pages) and the tenant quotas checked against it. CacheIndex keeps it in step as
// replicas enter and leave its trees, as paths are pinned and unpinned and as pools are
// dropped, so that every quota is checked in O(1). See docs/EVICTION.md ("Tenant quotas").
//
// Not thread-safe: guarded by its owner's lock (CacheIndex::mu_).
#ifndef KVCM_SERVER_CORE_TENANT_LEDGER_H_
#define KVCM_SERVER_CORE_TENANT_LEDGER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/types.h"
#include "server/core/byte_budget.h"

namespace kvcm {

// The tenant limits of CacheIndexOptions (0: unlimited), documented there.
struct TenantQuotas {
  uint64_t max_bytes = 0;         // tenant_max_bytes
  uint64_t max_pinned_bytes = 0;  // tenant_max_pinned_bytes
  uint32_t max_pins = 65'536;     // max_pins_per_tenant
  uint32_t pool_share_pct = 100;  // default_tenant_pool_share_pct; 100: no share
};

// One tenant's counts and usage. A record lives while the tenant has a namespace or a
// reservation. Tenant "" holds the operators' reservations, which no quota limits.
struct Tenant {
  Tenant(std::string name_in, uint32_t group_in) : name(std::move(name_in)), group(group_in) {}

  const std::string name;
  // The eviction policy's group of its trees (RadixTree::group).
  const uint32_t group;
  uint32_t namespaces = 0;
  uint32_t pins = 0;  // live
  // Its page-locations in live pools, and those of them a pin holds, in bytes; by pool
  // too (no zero entries), so that a dropped pool's share leaves at once.
  uint64_t stored_bytes = 0;
  uint64_t pinned_bytes = 0;
  struct PoolUse {
    uint64_t stored = 0;
    uint64_t pinned = 0;
  };
  absl::flat_hash_map<PoolId, PoolUse> by_pool;
  // Headroom it reserved, in all and by pool (keyed by PoolKey: a reservation outlives a
  // DropPool, as the pool's own count does). No zero entries.
  uint64_t reserved_bytes = 0;
  absl::flat_hash_map<PoolKey, uint64_t> reserved;
  // Page-locations of its namespaces in engine pools, retired ones included until they are
  // swept (max_engine_pages_per_tenant).
  uint64_t engine_pages = 0;

  // Unpinned bytes, all of which the policy can reach (pins cover whole root paths).
  uint64_t evictable() const { return stored_bytes - pinned_bytes; }
};

class TenantLedger {
 public:
  // `budget` (not owned, the owner's) says which pools are retired or an engine's, and
  // what each pool holds for the share.
  TenantLedger(TenantQuotas quotas, const ByteBudget& budget) : quotas_(quotas), budget_(budget) {}
  TenantLedger(const TenantLedger&) = delete;
  TenantLedger& operator=(const TenantLedger&) = delete;

  // The record of tenant `name`, created (with the next eviction group) if new.
  Tenant& Intern(const std::string& name);
  // Null when `name` has no record.
  Tenant* Find(const std::string& name);
  const Tenant* Find(const std::string& name) const;
  // Erases `tenant`'s record once it has neither a namespace nor a reservation.
  void MaybeForget(Tenant& tenant);
  size_t size() const { return tenants_.size(); }
  void ForEach(absl::FunctionRef<void(const Tenant&)> fn) const;

  // A replica of `pages` pages and `bytes` bytes entering / leaving pool `pool`, held by
  // a pin or not. Retired pools count for no one; an engine's pool counts its pages only.
  void Store(Tenant& tenant, PoolId pool, uint64_t pages, uint64_t bytes, bool pinned);
  void Unstore(Tenant& tenant, PoolId pool, uint64_t pages, uint64_t bytes, bool pinned);
  // A replica of `bytes` bytes in `pool` becoming pinned / unpinned.
  void Pin(Tenant& tenant, PoolId pool, uint64_t bytes, bool pinned);
  // Pool `pool` was retired: its bytes stop counting for every tenant.
  void DropPool(PoolId pool);

  // What `tenant` reserved in `pool`.
  uint64_t Reserved(const Tenant& tenant, const PoolKey& pool) const;
  void Reserve(Tenant& tenant, const PoolKey& pool, uint64_t bytes);
  // REQUIRES: bytes <= Reserved(tenant, pool). Keeps the record (see MaybeForget).
  void Unreserve(Tenant& tenant, const PoolKey& pool, uint64_t bytes);
  // Releases every tenant's reservation in `pool` (its agent left for good), forgetting
  // the records left with nothing.
  void ReleasePool(const PoolKey& pool);

  // The tenants the deployment knows (CacheIndex::SetConfiguredTenants).
  void set_configured_tenants(size_t count) { configured_tenants_ = count; }

  // RESOURCE_EXHAUSTED naming max_pins_per_tenant when `tenant` may take no more pins.
  absl::Status CheckPins(const Tenant& tenant) const;
  // RESOURCE_EXHAUSTED naming tenant_max_pinned_bytes when `adding` more pinned bytes
  // would pass it.
  absl::Status CheckPinnedBytes(const Tenant& tenant, uint64_t adding) const;
  // Bytes `tenant` must free before `adding` more fit within tenant_max_bytes (0 without a
  // quota, or for the operators' tenant "").
  uint64_t QuotaShortfall(const Tenant& tenant, uint64_t adding) const;
  // RESOURCE_EXHAUSTED naming tenant_max_bytes, for `what` ("the insert") needing `adding`.
  absl::Status QuotaExhausted(const Tenant& tenant, uint64_t adding, absl::string_view what) const;
  // default_tenant_pool_share_pct. Whether it is in force at all (no quota set, share <
  // 100); whether it applies to `tenant` (in force, not the operators); the bytes it allows
  // in live pool `pool`; and what `tenant` claims there: its reservation plus its pinned
  // bytes.
  bool ShareInForce() const;
  bool ShareApplies(const Tenant& tenant) const;
  uint64_t ShareCap(PoolId pool) const;
  uint64_t ShareClaim(const Tenant& tenant, PoolId pool) const;
  // Whether another tenant holds pages or a reservation in live pool `pool` (the operators'
  // reservations do not count), or more than one tenant is configured: only then does the
  // share limit `tenant` there.
  bool SharedWithOthers(const Tenant& tenant, PoolId pool) const;
  // OK when `adding` more bytes of reservation or pins keep `tenant` within its share of
  // `pool`; else RESOURCE_EXHAUSTED naming default_tenant_pool_share_pct, for `what`.
  absl::Status CheckShare(const Tenant& tenant, PoolId pool, uint64_t adding,
                          absl::string_view what) const;

 private:
  const TenantQuotas quotas_;
  const ByteBudget& budget_;
  // Tenants with a namespace or a reservation.
  absl::flat_hash_map<std::string, std::unique_ptr<Tenant>> tenants_;
  uint32_t next_group_ = 1;
  size_t configured_tenants_ = 0;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_TENANT_LEDGER_H_
