#include "server/core/tenant_ledger.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

const PoolKey kGpu{"a", Tier::kGpu};
const PoolKey kHost{"a", Tier::kHost};

// The fields a refusal must leave as they were.
struct Snapshot {
  uint32_t namespaces, pins;
  uint64_t stored, pinned, reserved, engine_pages;
  size_t pools, reservations;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};
Snapshot Snap(const Tenant& t) {
  return {t.namespaces,     t.pins,         t.stored_bytes,   t.pinned_bytes,
          t.reserved_bytes, t.engine_pages, t.by_pool.size(), t.reserved.size()};
}

TEST(TenantLedgerTest, InternGivesEachTenantItsOwnGroupAndForgetsEmptyRecords) {
  ByteBudget budget;
  TenantLedger ledger({}, budget);
  Tenant& acme = ledger.Intern("acme");
  Tenant& globex = ledger.Intern("globex");
  EXPECT_NE(acme.group, globex.group);
  EXPECT_EQ(&ledger.Intern("acme"), &acme);
  EXPECT_EQ(ledger.size(), 2u);
  ++acme.namespaces;
  ledger.MaybeForget(acme);  // has a namespace: kept
  ledger.MaybeForget(globex);
  EXPECT_EQ(ledger.Find("globex"), nullptr);
  ASSERT_EQ(ledger.Find("acme"), &acme);
  --acme.namespaces;
  ledger.MaybeForget(acme);
  EXPECT_EQ(ledger.size(), 0u);
  // A new record gets a new group: a forgotten tenant's old trees are gone with it.
  EXPECT_NE(ledger.Intern("globex").group, 2u);
}

TEST(TenantLedgerTest, StoreAndUnstoreChargeAndReleaseBytesByPool) {
  ByteBudget budget;
  const PoolId gpu = budget.Intern(kGpu, 1000);
  const PoolId host = budget.Intern(kHost, 1000);
  TenantLedger ledger({}, budget);
  Tenant& t = ledger.Intern("acme");
  ledger.Store(t, gpu, 2, 200, /*pinned=*/false);
  ledger.Store(t, host, 1, 100, /*pinned=*/true);
  EXPECT_EQ(t.stored_bytes, 300u);
  EXPECT_EQ(t.pinned_bytes, 100u);
  EXPECT_EQ(t.evictable(), 200u);
  EXPECT_EQ(t.by_pool.at(gpu).stored, 200u);
  EXPECT_EQ(t.by_pool.at(host).pinned, 100u);

  ledger.Pin(t, gpu, 200, true);
  EXPECT_EQ(t.pinned_bytes, 300u);
  ledger.Pin(t, gpu, 200, false);
  EXPECT_EQ(t.pinned_bytes, 100u);

  ledger.Unstore(t, host, 1, 100, /*pinned=*/true);
  EXPECT_EQ(t.stored_bytes, 200u);
  EXPECT_EQ(t.pinned_bytes, 0u);
  EXPECT_FALSE(t.by_pool.contains(host));  // no zero entries
  ledger.Unstore(t, gpu, 2, 200, /*pinned=*/false);
  EXPECT_TRUE(t.by_pool.empty());
  EXPECT_EQ(t.stored_bytes, 0u);
}

TEST(TenantLedgerTest, EnginePoolsCountPagesAndRetiredPoolsCountForNoOne) {
  ByteBudget budget;
  const PoolId engine = budget.Intern(PoolKey{"engine", Tier::kGpu}, 0, /*engine=*/true);
  const PoolId gpu = budget.Intern(kGpu, 1000);
  TenantLedger ledger({}, budget);
  Tenant& t = ledger.Intern("acme");
  ledger.Store(t, engine, 4, 400, /*pinned=*/true);
  EXPECT_EQ(t.engine_pages, 4u);
  EXPECT_EQ(t.stored_bytes, 0u);
  EXPECT_EQ(t.pinned_bytes, 0u);
  ledger.Pin(t, engine, 400, false);  // nothing to unpin
  EXPECT_EQ(t.pinned_bytes, 0u);
  ledger.Unstore(t, engine, 4, 400, /*pinned=*/true);
  EXPECT_EQ(t.engine_pages, 0u);

  ledger.Store(t, gpu, 1, 100, /*pinned=*/true);
  budget.Replace(gpu);
  ledger.DropPool(gpu);
  EXPECT_EQ(t.stored_bytes, 0u);
  EXPECT_EQ(t.pinned_bytes, 0u);
  EXPECT_TRUE(t.by_pool.empty());
  // The retired replica leaves the tree later: it changes nothing then.
  ledger.Pin(t, gpu, 100, false);
  ledger.Unstore(t, gpu, 1, 100, /*pinned=*/false);
  EXPECT_EQ(Snap(t), Snap(Tenant("x", 0)));
}

TEST(TenantLedgerTest, ReservationsAddUpAndReleasePoolForgetsWhatIsLeftEmpty) {
  ByteBudget budget;
  budget.Intern(kGpu, 1000);
  TenantLedger ledger({}, budget);
  Tenant& acme = ledger.Intern("acme");
  ledger.Reserve(acme, kGpu, 100);
  ledger.Reserve(acme, kGpu, 50);
  ledger.Reserve(acme, kHost, 10);
  EXPECT_EQ(ledger.Reserved(acme, kGpu), 150u);
  EXPECT_EQ(acme.reserved_bytes, 160u);
  ledger.Unreserve(acme, kGpu, 150);
  EXPECT_EQ(ledger.Reserved(acme, kGpu), 0u);
  EXPECT_FALSE(acme.reserved.contains(kGpu));  // no zero entries
  ledger.Unreserve(acme, kHost, 0);            // nothing
  EXPECT_EQ(acme.reserved_bytes, 10u);

  Tenant& ops = ledger.Intern("");
  ledger.Reserve(ops, kHost, 5);
  Tenant& globex = ledger.Intern("globex");
  ++globex.namespaces;
  ledger.Reserve(globex, kHost, 7);
  ledger.ReleasePool(kHost);
  EXPECT_EQ(ledger.Find("acme"), nullptr);
  EXPECT_EQ(ledger.Find(""), nullptr);
  ASSERT_EQ(ledger.Find("globex"), &globex);  // still has a namespace
  EXPECT_EQ(globex.reserved_bytes, 0u);
}

TEST(TenantLedgerTest, QuotaShortfallCountsPagesAndReservationsButNotTheOperators) {
  ByteBudget budget;
  const PoolId gpu = budget.Intern(kGpu, 10'000);
  TenantLedger ledger({.max_bytes = 1000}, budget);
  Tenant& t = ledger.Intern("acme");
  ledger.Store(t, gpu, 6, 600, /*pinned=*/false);
  ledger.Reserve(t, kGpu, 300);
  EXPECT_EQ(ledger.QuotaShortfall(t, 100), 0u);
  EXPECT_EQ(ledger.QuotaShortfall(t, 150), 50u);
  Tenant& ops = ledger.Intern("");
  ledger.Reserve(ops, kGpu, 5000);
  EXPECT_EQ(ledger.QuotaShortfall(ops, 5000), 0u);

  TenantLedger unlimited({}, budget);
  EXPECT_EQ(unlimited.QuotaShortfall(t, 1 << 30), 0u);

  const Snapshot before = Snap(t);
  const absl::Status s = ledger.QuotaExhausted(t, 500, "the insert");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "tenant_max_bytes: tenant acme holds 900 of its 1000 bytes (600 of pages, 0 of them "
            "pinned, and 300 reserved); the insert needs 500 more and only 600 of its bytes are "
            "evictable (nothing changed)");
  EXPECT_EQ(Snap(t), before);
}

TEST(TenantLedgerTest, PinLimitsRefuseWithoutChangingAnything) {
  ByteBudget budget;
  const PoolId gpu = budget.Intern(kGpu, 10'000);
  TenantLedger ledger({.max_pinned_bytes = 500, .max_pins = 2}, budget);
  Tenant& t = ledger.Intern("acme");
  ledger.Store(t, gpu, 4, 400, /*pinned=*/true);
  t.pins = 1;
  EXPECT_TRUE(ledger.CheckPins(t).ok());
  EXPECT_TRUE(ledger.CheckPinnedBytes(t, 100).ok());
  const Snapshot before = Snap(t);
  absl::Status s = ledger.CheckPinnedBytes(t, 101);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "tenant_max_pinned_bytes: tenant acme has 400 bytes pinned (1 pins) of its 500; this "
            "pin would add 101; release some (nothing was matched or pinned)");
  t.pins = 2;
  s = ledger.CheckPins(t);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("max_pins_per_tenant: tenant acme holds 2"));
  t.pins = 1;
  EXPECT_EQ(Snap(t), before);

  TenantLedger unlimited({}, budget);
  EXPECT_TRUE(unlimited.CheckPinnedBytes(t, uint64_t{1} << 40).ok());
}

TEST(TenantLedgerTest, TheShareLimitsReservationsAndPinsOnlyInAPoolSharedWithOthers) {
  ByteBudget budget;
  const PoolId gpu = budget.Intern(kGpu, 1000);
  TenantLedger ledger({.pool_share_pct = 50}, budget);
  EXPECT_TRUE(ledger.ShareInForce());
  EXPECT_EQ(ledger.ShareCap(gpu), 500u);
  Tenant& acme = ledger.Intern("acme");
  Tenant& ops = ledger.Intern("");
  EXPECT_TRUE(ledger.ShareApplies(acme));
  EXPECT_FALSE(ledger.ShareApplies(ops));

  // Alone in the pool (the operators' reservations do not count): no limit.
  budget.Charge(gpu, 3, 300);
  ledger.Store(acme, gpu, 3, 300, /*pinned=*/true);
  budget.Reserve(gpu, 200);
  ledger.Reserve(ops, kGpu, 200);
  EXPECT_FALSE(ledger.SharedWithOthers(acme, gpu));
  EXPECT_TRUE(ledger.CheckShare(acme, gpu, 400, "the reservation").ok());

  // Another tenant's pages make it shared.
  Tenant& globex = ledger.Intern("globex");
  budget.Charge(gpu, 1, 100);
  ledger.Store(globex, gpu, 1, 100, /*pinned=*/false);
  EXPECT_TRUE(ledger.SharedWithOthers(acme, gpu));
  budget.Reserve(gpu, 100);
  ledger.Reserve(acme, kGpu, 100);
  EXPECT_EQ(ledger.ShareClaim(acme, gpu), 400u);  // 300 pinned + 100 reserved
  EXPECT_TRUE(ledger.CheckShare(acme, gpu, 100, "the reservation").ok());
  const Snapshot before = Snap(acme);
  const absl::Status s = ledger.CheckShare(acme, gpu, 101, "the reservation");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "default_tenant_pool_share_pct: tenant acme may reserve and pin at most 50% (500 "
            "bytes) of pool a:gpu and holds 400 (100 reserved, 300 pinned); the reservation "
            "would add 101 while other tenants use the pool (nothing changed; an operator may "
            "set tenant quotas instead)");
  EXPECT_EQ(Snap(acme), before);

  // Configured tenants are owed their share from the first byte.
  ledger.set_configured_tenants(3);
  EXPECT_TRUE(ledger.SharedWithOthers(ops, gpu));
  EXPECT_THAT(std::string(ledger.CheckShare(acme, gpu, 101, "this pin").message()),
              HasSubstr("this pin would add 101 while 3 tenants are configured"));
}

TEST(TenantLedgerTest, AQuotaOrAFullShareTurnsTheShareOff) {
  ByteBudget budget;
  EXPECT_FALSE(TenantLedger({.max_bytes = 1, .pool_share_pct = 50}, budget).ShareInForce());
  EXPECT_FALSE(TenantLedger({.max_pinned_bytes = 1, .pool_share_pct = 50}, budget).ShareInForce());
  EXPECT_FALSE(TenantLedger({.pool_share_pct = 100}, budget).ShareInForce());
  // capacity x pct / 100 without overflow near 2^64.
  const PoolId huge = budget.Intern(kGpu, ~uint64_t{0});
  EXPECT_EQ(TenantLedger({.pool_share_pct = 50}, budget).ShareCap(huge), ~uint64_t{0} / 2);
}

}  // namespace
}  // namespace kvcm
