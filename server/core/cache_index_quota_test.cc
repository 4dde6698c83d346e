// Tenant quotas: tenant_max_bytes at Insert and Reserve, tenant_max_pinned_bytes at
// Match(pin), reservations per tenant, and the per-tenant counters through everything that
// adds or removes replicas (CheckTenantAccounting recomputes them from the tree).
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/cache_index.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kPage = 4;  // tokens per page

ModelSpec Mla() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = kPage};
}

class CacheIndexQuotaTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kQuotaPages = 4;

  void SetUp() override { Reset({.tenant_max_bytes = kQuotaPages * bpp_}); }

  void Reset(CacheIndexOptions options) {
    options.clock = &clock_;
    options.hash_secret = HashKey{11, 22};
    index_ = std::make_unique<CacheIndex>(options);
    ASSERT_TRUE(index_->RegisterModel(a_, Mla()).ok());
    ASSERT_TRUE(index_->RegisterModel(b_, Mla()).ok());
    for (const PoolKey& p : {gpu0_, gpu1_}) {
      ASSERT_TRUE(index_->SetPoolCapacity(p, 100 * bpp_).ok());
    }
  }

  std::vector<PageHash> Prompt(const NamespaceId& ns, std::vector<int32_t> page_ids) {
    std::vector<int32_t> tokens;
    for (int32_t id : page_ids) tokens.insert(tokens.end(), kPage, id);
    return *index_->HashTokens(ns, tokens);
  }

  static std::vector<BlockId> Blocks(size_t n) {
    std::vector<BlockId> b(n);
    std::iota(b.begin(), b.end(), 0);
    return b;
  }

  absl::StatusOr<InsertResult> Insert(const NamespaceId& ns, std::vector<int32_t> ids,
                                      const PoolKey& pool, InsertOptions options = {}) {
    std::vector<PageHash> pages = Prompt(ns, std::move(ids));
    return index_->Insert(ns, pages, pool, Blocks(pages.size()), options);
  }

  void MustInsert(const NamespaceId& ns, std::vector<int32_t> ids, const PoolKey& pool) {
    absl::StatusOr<InsertResult> r = Insert(ns, std::move(ids), pool);
    ASSERT_TRUE(r.ok()) << r.status();
  }

  uint32_t Cached(const NamespaceId& ns, std::vector<int32_t> ids) {
    absl::StatusOr<MatchResult> m = index_->Match(ns, Prompt(ns, std::move(ids)), {.probe = true});
    return m.ok() ? m->matched_pages : 0;
  }

  absl::StatusOr<MatchResult> Pin(const NamespaceId& ns, std::vector<int32_t> ids,
                                  absl::Duration ttl = absl::ZeroDuration()) {
    return index_->Match(ns, Prompt(ns, std::move(ids)), {.pin = true, .lease_ttl = ttl});
  }

  PoolStats PoolOf(const PoolKey& key) {
    for (const PoolStats& p : index_->Stats().pools) {
      if (p.pool == key) return p;
    }
    return PoolStats{};
  }

  TenantStats Tenant(const std::string& name) {
    for (const TenantStats& t : index_->Stats().tenants) {
      if (t.tenant == name) return t;
    }
    return TenantStats{.tenant = "(none)"};
  }

  // Everything a refused call must leave as it was, for every tenant.
  using Snapshot = std::tuple<
      std::vector<std::tuple<std::string, uint64_t, uint64_t, uint64_t>>,
      std::vector<std::tuple<std::string, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>>,
      std::vector<uint64_t>>;
  Snapshot Snap() {
    IndexStats s = index_->Stats();
    Snapshot snap;
    for (const PoolStats& p : s.pools) {
      std::get<0>(snap).emplace_back(p.pool.ToString(), p.used_bytes, p.pinned_bytes,
                                     p.reserved_bytes);
    }
    for (const TenantStats& t : s.tenants) {
      std::get<1>(snap).emplace_back(t.tenant, t.namespaces, t.stored_bytes, t.pinned_bytes,
                                     t.reserved_bytes, t.pins);
    }
    std::get<2>(snap) = {s.counters.inserted_pages, s.counters.evicted_pages,
                         s.counters.match_requests, s.counters.pins_taken, s.active_pins};
    for (const NamespaceStats& n : s.namespaces) std::get<2>(snap).push_back(n.page_locations);
    return snap;
  }

  void ExpectConsistent() {
    absl::Status s = index_->CheckTenantAccounting();
    EXPECT_TRUE(s.ok()) << s;
  }

  FakeClock clock_;
  const uint64_t bpp_ = Mla().BytesPerPage();
  NamespaceId a_{"acme", "m"};
  NamespaceId b_{"globex", "m"};
  PoolKey gpu0_{"gpu-0", Tier::kGpu};
  PoolKey gpu1_{"gpu-1", Tier::kGpu};
  std::unique_ptr<CacheIndex> index_;
};

TEST_F(CacheIndexQuotaTest, AnInsertPastTheQuotaEvictsOnlyTheTenantsOwnPages) {
  MustInsert(b_, {1}, gpu0_);
  MustInsert(b_, {2}, gpu0_);
  for (int32_t id = 1; id <= 4; ++id) MustInsert(a_, {id}, gpu0_);
  EXPECT_EQ(Tenant("acme").stored_bytes, 4 * bpp_);
  MustInsert(b_, {3}, gpu0_);  // globex's newest page: the pool's LRU order is no excuse

  // A fifth page of acme's: its own least recently used page goes, globex keeps all three.
  absl::StatusOr<InsertResult> fifth = Insert(a_, {5}, gpu0_);
  ASSERT_TRUE(fifth.ok()) << fifth.status();
  EXPECT_EQ(fifth->evicted_bytes, bpp_);
  EXPECT_EQ(Cached(a_, {1}), 0u);
  for (int32_t id = 2; id <= 5; ++id) EXPECT_EQ(Cached(a_, {id}), 1u) << id;
  for (int32_t id = 1; id <= 3; ++id) EXPECT_EQ(Cached(b_, {id}), 1u) << id;
  EXPECT_EQ(Tenant("acme").stored_bytes, 4 * bpp_);
  EXPECT_EQ(Tenant("globex").stored_bytes, 3 * bpp_);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, EveryReplicaCountsAndTheOldestGoesFirstAcrossPools) {
  MustInsert(a_, {1}, gpu0_);
  MustInsert(a_, {1}, gpu1_);  // a second copy of the same page: two pages' worth
  MustInsert(a_, {2}, gpu1_);
  EXPECT_EQ(Tenant("acme").stored_bytes, 3 * bpp_);
  MustInsert(a_, {3}, gpu0_);
  // Touch page 1 (both copies); page 2, in gpu1 only, is now acme's least recently used.
  EXPECT_EQ(Cached(a_, {1}), 1u);
  ASSERT_TRUE(index_->Match(a_, Prompt(a_, {1}), {}).ok());
  // Into gpu0, but acme's victim is in gpu1: a quota is the tenant's, not the pool's.
  ASSERT_TRUE(Insert(a_, {4}, gpu0_).ok());
  EXPECT_EQ(Cached(a_, {2}), 0u);
  EXPECT_EQ(Cached(a_, {1}), 1u);
  EXPECT_EQ(Tenant("acme").stored_bytes, 4 * bpp_);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, ARefusedInsertChangesNothingForEitherTenant) {
  MustInsert(b_, {1, 2}, gpu0_);
  MustInsert(a_, {1, 2, 3}, gpu0_);
  ASSERT_TRUE(Pin(a_, {1, 2, 3}).ok());
  MustInsert(a_, {9}, gpu1_);
  ASSERT_TRUE(Pin(a_, {9}).ok());  // all four of acme's pages are pinned
  const Snapshot before = Snap();

  absl::StatusOr<InsertResult> r = Insert(a_, {5}, gpu0_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("tenant_max_bytes"));
  EXPECT_THAT(r.status().message(), HasSubstr("tenant acme"));
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat(4 * bpp_, " of pages, ", 4 * bpp_,
                                                           " of them pinned, and 0 reserved")));
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("the insert needs ", bpp_)));
  EXPECT_EQ(Snap(), before);
  // Even when only part of it would be over: an insert evicts all it needs or nothing.
  EXPECT_EQ(Insert(a_, {1, 2, 3, 4}, gpu0_).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snap(), before);
  // Globex, far from the quota, is not held back.
  MustInsert(b_, {3}, gpu0_);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, AnInsertLargerThanTheQuotaIsRefused) {
  MustInsert(a_, {1}, gpu0_);
  const Snapshot before = Snap();
  EXPECT_EQ(Insert(a_, {2, 3, 4, 5, 6}, gpu0_).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snap(), before);
  EXPECT_EQ(Cached(a_, {1}), 1u);
}

TEST_F(CacheIndexQuotaTest, ThePinnedBytesBudgetRefusesAndIsGivenBack) {
  Reset({.tenant_max_bytes = 10 * bpp_, .tenant_max_pinned_bytes = 3 * bpp_});
  MustInsert(a_, {1, 2}, gpu0_);
  MustInsert(a_, {1, 2}, gpu1_);  // two copies: pinning pages 1-2 holds four pages' bytes
  MustInsert(a_, {7}, gpu0_);
  MustInsert(b_, {1, 2, 3}, gpu0_);

  const Snapshot before = Snap();
  absl::StatusOr<MatchResult> both = Pin(a_, {1, 2});
  EXPECT_EQ(both.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(both.status().message(), HasSubstr("tenant_max_pinned_bytes"));
  EXPECT_THAT(both.status().message(), HasSubstr("tenant acme"));
  EXPECT_EQ(Snap(), before) << "nothing matched, pinned or counted";

  absl::StatusOr<MatchResult> one = Pin(a_, {1});  // 2 replicas x 1 page
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(Tenant("acme").pinned_bytes, 2 * bpp_);
  // A page under several pins counts once: pinning it again is free.
  absl::StatusOr<MatchResult> again = Pin(a_, {1}, absl::Seconds(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Tenant("acme").pinned_bytes, 2 * bpp_);
  EXPECT_EQ(Tenant("acme").pins, 2u);
  ASSERT_TRUE(Pin(a_, {7}, absl::Seconds(1)).ok());  // the last page of the budget
  EXPECT_EQ(Pin(a_, {1, 2}).status().code(), absl::StatusCode::kResourceExhausted);
  // Another tenant's budget is its own.
  ASSERT_TRUE(Pin(b_, {1, 2, 3}).ok());
  ExpectConsistent();

  // Expiry gives page 7 back (page 1 stays: `one` still holds it).
  clock_.Advance(absl::Seconds(2));
  index_->ExpireLeases();
  EXPECT_EQ(Tenant("acme").pinned_bytes, 2 * bpp_);
  EXPECT_EQ(Tenant("acme").pins, 1u);
  EXPECT_EQ(Pin(a_, {1, 2}).status().code(), absl::StatusCode::kResourceExhausted);
  // Release gives the rest back.
  ASSERT_TRUE(index_->Release(a_, one->pin_id).ok());
  EXPECT_EQ(Tenant("acme").pinned_bytes, 0u);
  absl::StatusOr<MatchResult> two = Pin(a_, {1});
  ASSERT_TRUE(two.ok()) << two.status();
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, DeleteNamespaceGivesBackItsBytesAndPins) {
  Reset({.tenant_max_bytes = 10 * bpp_, .tenant_max_pinned_bytes = 2 * bpp_});
  const NamespaceId a2{"acme", "other"};
  ASSERT_TRUE(index_->RegisterModel(a2, Mla()).ok());
  MustInsert(a_, {1, 2}, gpu0_);
  ASSERT_TRUE(Pin(a_, {1, 2}).ok());
  MustInsert(a2, {1}, gpu0_);
  EXPECT_EQ(Pin(a2, {1}).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(index_->DeleteNamespace(a_).ok());
  TenantStats acme = Tenant("acme");
  EXPECT_EQ(acme.namespaces, 1u);
  EXPECT_EQ(acme.stored_bytes, bpp_);
  EXPECT_EQ(acme.pinned_bytes, 0u);
  EXPECT_EQ(acme.pins, 0u);
  ASSERT_TRUE(Pin(a2, {1}).ok());
  ExpectConsistent();
  // The tenant's last namespace takes its record with it (no reservation keeps it).
  ASSERT_TRUE(index_->DeleteNamespace(a2).ok());
  EXPECT_EQ(Tenant("acme").tenant, "(none)");
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, ReservationsBelongToTheirTenant) {
  ASSERT_TRUE(index_->Reserve(gpu0_, 2 * bpp_, "acme").ok());
  EXPECT_EQ(Tenant("acme").reserved_bytes, 2 * bpp_);
  const Snapshot before = Snap();
  // Globex cannot give back acme's headroom ...
  absl::Status taken = index_->Unreserve(gpu0_, bpp_, "globex");
  EXPECT_EQ(taken.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(taken.message(), HasSubstr("tenant globex"));
  EXPECT_EQ(Snap(), before);
  // ... nor draw on it: its insert leaves it reserved.
  ASSERT_TRUE(Insert(b_, {1}, gpu0_, {.use_reservation = true}).ok());
  EXPECT_EQ(Tenant("acme").reserved_bytes, 2 * bpp_);
  EXPECT_EQ(PoolOf(gpu0_).reserved_bytes, 2 * bpp_);
  // Acme's own insert does, in that pool only.
  ASSERT_TRUE(Insert(a_, {1}, gpu1_, {.use_reservation = true}).ok());
  EXPECT_EQ(Tenant("acme").reserved_bytes, 2 * bpp_);
  ASSERT_TRUE(Insert(a_, {1}, gpu0_, {.use_reservation = true}).ok());
  EXPECT_EQ(Tenant("acme").reserved_bytes, bpp_);
  EXPECT_EQ(index_->Unreserve(gpu0_, 2 * bpp_, "acme").code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(index_->Unreserve(gpu0_, bpp_, "acme").ok());
  EXPECT_EQ(Tenant("acme").reserved_bytes, 0u);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, AReservationCountsAgainstTheQuota) {
  MustInsert(a_, {1}, gpu0_);
  MustInsert(a_, {2}, gpu0_);
  MustInsert(a_, {3}, gpu0_);
  ASSERT_TRUE(Pin(a_, {3}).ok());
  // 3 held + 2 reserved: acme's own LRU page makes the room.
  absl::StatusOr<uint64_t> evicted = index_->Reserve(gpu1_, 2 * bpp_, "acme");
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_EQ(*evicted, bpp_);
  EXPECT_EQ(Cached(a_, {1}), 0u);
  EXPECT_EQ(Tenant("acme").stored_bytes + Tenant("acme").reserved_bytes, 4 * bpp_);
  // Beyond what its unpinned pages can free: refused, naming the quota, nothing changed.
  const Snapshot before = Snap();
  absl::StatusOr<uint64_t> more = index_->Reserve(gpu0_, 2 * bpp_, "acme");
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), HasSubstr("tenant_max_bytes"));
  EXPECT_THAT(more.status().message(), HasSubstr(absl::StrCat(2 * bpp_, " reserved")));
  EXPECT_THAT(more.status().message(), HasSubstr("the reservation needs"));
  EXPECT_EQ(Snap(), before);
  // The reserved bytes, taken by an insert, stay within the quota: no eviction needed.
  absl::StatusOr<InsertResult> own = Insert(a_, {5, 6}, gpu1_, {.use_reservation = true});
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->evicted_bytes, 0u);
  EXPECT_EQ(Tenant("acme").stored_bytes, 4 * bpp_);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, ATenantCannotReserveAPoolFullToStarveAnother) {
  const PoolKey small{"gpu-2", Tier::kGpu};
  // Without a quota or a default share the attack works: globex takes the whole pool,
  // acme's insert fails.
  Reset({.default_tenant_pool_share_pct = 100});
  ASSERT_TRUE(index_->SetPoolCapacity(small, 8 * bpp_).ok());
  ASSERT_TRUE(index_->Reserve(small, 8 * bpp_, "globex").ok());
  EXPECT_EQ(Insert(a_, {1}, small).status().code(), absl::StatusCode::kResourceExhausted);

  // With one it fails for globex.
  Reset({.tenant_max_bytes = kQuotaPages * bpp_});
  ASSERT_TRUE(index_->SetPoolCapacity(small, 8 * bpp_).ok());
  absl::StatusOr<uint64_t> all = index_->Reserve(small, 8 * bpp_, "globex");
  EXPECT_EQ(all.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(all.status().message(), HasSubstr("tenant_max_bytes: tenant globex"));
  ASSERT_TRUE(index_->Reserve(small, kQuotaPages * bpp_, "globex").ok());
  EXPECT_EQ(index_->Reserve(small, 1, "globex").status().code(),
            absl::StatusCode::kResourceExhausted);
  for (int32_t id = 1; id <= 4; ++id) {
    absl::StatusOr<InsertResult> r = Insert(a_, {id}, small);
    EXPECT_TRUE(r.ok()) << r.status();
  }
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, OperatorReservationsHaveNoQuotaAndNoInsertTakesThem) {
  absl::StatusOr<uint64_t> r = index_->Reserve(gpu0_, 10 * bpp_, "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Tenant("").reserved_bytes, 10 * bpp_);
  ASSERT_TRUE(Insert(a_, {1}, gpu0_, {.use_reservation = true}).ok());
  EXPECT_EQ(Tenant("").reserved_bytes, 10 * bpp_);
  absl::Status s = index_->Unreserve(gpu0_, bpp_, "acme");
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  s = index_->Unreserve(gpu0_, 11 * bpp_, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("the operators"));
  ASSERT_TRUE(index_->Unreserve(gpu0_, 10 * bpp_, "").ok());
  EXPECT_EQ(Tenant("").tenant, "(none)") << "an empty record is dropped";
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, AReservationOutlivesADroppedPool) {
  ASSERT_TRUE(index_->Reserve(gpu0_, bpp_, "acme").ok());
  MustInsert(a_, {1, 2}, gpu0_);
  ASSERT_TRUE(index_->DropPool(gpu0_).ok());
  EXPECT_EQ(Tenant("acme").stored_bytes, 0u);
  EXPECT_EQ(Tenant("acme").reserved_bytes, bpp_);
  ASSERT_TRUE(Insert(a_, {3}, gpu0_, {.use_reservation = true}).ok());
  EXPECT_EQ(Tenant("acme").reserved_bytes, 0u);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, ADemotionNeverTakesATenantPastItsQuota) {
  Reset({.policy = "cost", .tenant_max_bytes = 6 * bpp_});
  const PoolKey gpu{"gpu-9", Tier::kGpu};
  const PoolKey host{"gpu-9", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(gpu, 4 * bpp_).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 100 * bpp_).ok());
  MustInsert(b_, {1}, gpu);
  MustInsert(b_, {2}, gpu);
  MustInsert(a_, {1}, gpu);
  MustInsert(a_, {2}, gpu);
  for (int32_t id = 3; id <= 6; ++id) MustInsert(a_, {id}, host);  // acme is at its quota
  ExpectConsistent();
  // Pool gpu is full: each insert evicts its least recently used page. Globex has room, so
  // its pages b1 and b2 move to the HOST pool.
  MustInsert(b_, {3}, gpu);
  MustInsert(b_, {4}, gpu);
  EXPECT_EQ(index_->Stats().counters.demoted_pages, 2u);
  EXPECT_EQ(Cached(b_, {1}) + Cached(b_, {2}), 2u) << "demoted to HOST";
  // A copy of a1 would take acme past its quota: a1 leaves instead.
  MustInsert(b_, {5}, gpu);
  EXPECT_EQ(index_->Stats().counters.demoted_pages, 2u);
  EXPECT_EQ(Cached(a_, {1}), 0u);
  EXPECT_EQ(Tenant("acme").stored_bytes, 5 * bpp_);
  // That made room for a copy of a2.
  MustInsert(b_, {6}, gpu);
  EXPECT_EQ(index_->Stats().counters.demoted_pages, 3u);
  EXPECT_EQ(Cached(a_, {2}), 1u);
  EXPECT_EQ(Tenant("acme").stored_bytes, 5 * bpp_);
  EXPECT_EQ(Tenant("globex").stored_bytes, 6 * bpp_);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, CountersFollowDropSweepExpiryAndCapacityCuts) {
  Reset({.tenant_max_bytes = 6 * bpp_, .default_max_page_age = absl::Seconds(60)});
  MustInsert(a_, {1, 2}, gpu0_);
  MustInsert(a_, {1, 2, 3}, gpu1_);
  MustInsert(b_, {1}, gpu1_);
  absl::StatusOr<MatchResult> pin = Pin(a_, {1, 2});
  ASSERT_TRUE(pin.ok());
  ExpectConsistent();
  ASSERT_TRUE(index_->DropPool(gpu0_).ok());
  EXPECT_EQ(Tenant("acme").stored_bytes, 3 * bpp_);
  EXPECT_EQ(Tenant("acme").pinned_bytes, 2 * bpp_);
  ExpectConsistent();
  // The retired replicas leave without counting twice.
  while (index_->SweepRetired(1).removed_replicas > 0) {
  }
  ExpectConsistent();
  ASSERT_TRUE(index_->Release(a_, pin->pin_id).ok());
  while (index_->SweepRetired(1).removed_replicas > 0) {
  }
  ExpectConsistent();
  MustInsert(a_, {7}, gpu0_);
  ASSERT_TRUE(index_->SetPoolCapacity(gpu1_, bpp_).ok());  // evicts down to one page
  EXPECT_LE(PoolOf(gpu1_).used_bytes, bpp_);
  ExpectConsistent();
  clock_.Advance(absl::Seconds(61));
  while (index_->SweepExpired(1).more) {
  }
  EXPECT_EQ(Tenant("acme").stored_bytes, 0u);
  EXPECT_EQ(Tenant("globex").stored_bytes, 0u);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, QuotaEvictionSweepsRetiredReplicasOnTheWay) {
  MustInsert(a_, {1, 2}, gpu0_);
  ASSERT_TRUE(index_->DropPool(gpu0_).ok());  // not swept: still candidates of acme's
  for (int32_t id = 1; id <= 5; ++id) MustInsert(a_, {10 + id}, gpu1_);
  EXPECT_EQ(Tenant("acme").stored_bytes, 4 * bpp_);
  EXPECT_EQ(index_->SweepRetired(0).remaining_pages, 0u);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, StatsListTenantsAndQuotas) {
  Reset({.tenant_max_bytes = 8 * bpp_, .tenant_max_pinned_bytes = 2 * bpp_});
  MustInsert(a_, {1, 2}, gpu0_);
  ASSERT_TRUE(Pin(a_, {1}).ok());
  ASSERT_TRUE(index_->Reserve(gpu1_, bpp_, "acme").ok());
  IndexStats s = index_->Stats();
  EXPECT_EQ(s.tenant_max_bytes, 8 * bpp_);
  EXPECT_EQ(s.tenant_max_pinned_bytes, 2 * bpp_);
  ASSERT_EQ(s.tenants.size(), 2u);
  EXPECT_EQ(s.tenants[0].tenant, "acme");
  EXPECT_EQ(s.tenants[0].namespaces, 1u);
  EXPECT_EQ(s.tenants[0].stored_bytes, 2 * bpp_);
  EXPECT_EQ(s.tenants[0].pinned_bytes, bpp_);
  EXPECT_EQ(s.tenants[0].reserved_bytes, bpp_);
  EXPECT_EQ(s.tenants[0].pins, 1u);
  EXPECT_EQ(s.tenants[0].held_bytes(), 3 * bpp_);
  EXPECT_EQ(s.tenants[1].tenant, "globex");
  EXPECT_EQ(s.tenants[1].held_bytes(), 0u);
}

// Fair by default: issue 22's attack, globex reserving 94% of a pool acme uses, with no
// quota configured.
TEST_F(CacheIndexQuotaTest, FairByDefaultAReservationStopsAtTheShareOfASharedPool) {
  Reset({});
  const PoolKey small{"gpu-2", Tier::kGpu};
  ASSERT_TRUE(index_->SetPoolCapacity(small, 16 * bpp_).ok());
  MustInsert(a_, {1, 2, 3, 4}, small);  // acme uses the pool: 4 of 16 pages
  EXPECT_EQ(PoolOf(small).tenant_share_bytes, 8 * bpp_);
  EXPECT_EQ(index_->Stats().default_tenant_pool_share_pct, 50u);

  const Snapshot before = Snap();
  absl::StatusOr<uint64_t> most = index_->Reserve(small, 15 * bpp_, "globex");  // 94%
  EXPECT_EQ(most.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(most.status().message(), HasSubstr("default_tenant_pool_share_pct: tenant globex"));
  EXPECT_EQ(Snap(), before) << "a refused reservation changes nothing";
  EXPECT_EQ(Tenant("globex").reserved_bytes, 0u);

  absl::StatusOr<uint64_t> half = index_->Reserve(small, 8 * bpp_, "globex");
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ(*half, 0u) << "half the pool was free: nothing of acme's evicted";
  absl::StatusOr<uint64_t> more = index_->Reserve(small, 1, "globex");
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), HasSubstr("default_tenant_pool_share_pct"));

  // acme keeps its pages and can still insert into what globex could not take.
  EXPECT_EQ(Cached(a_, {1, 2, 3, 4}), 4u);
  MustInsert(a_, {5, 6, 7, 8}, small);
  EXPECT_EQ(Cached(a_, {5, 6, 7, 8}), 4u);
  // An operator's reservation is not a tenant's and has no share.
  ASSERT_TRUE(index_->Unreserve(small, 8 * bpp_, "globex").ok());
  ASSERT_TRUE(index_->Reserve(small, 8 * bpp_, "").ok());
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, FairByDefaultPinsAndReservationsShareOneCap) {
  Reset({});
  const PoolKey small{"gpu-2", Tier::kGpu};
  ASSERT_TRUE(index_->SetPoolCapacity(small, 8 * bpp_).ok());
  MustInsert(a_, {9}, small);
  MustInsert(b_, {1, 2, 3, 4}, small);
  ASSERT_TRUE(index_->Reserve(small, 2 * bpp_, "globex").ok());

  // 2 reserved + 3 pinned > 4 (half of 8).
  const Snapshot before = Snap();
  absl::StatusOr<MatchResult> big = Pin(b_, {1, 2, 3});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("default_tenant_pool_share_pct: tenant globex"));
  EXPECT_THAT(big.status().message(),
              HasSubstr("(" + std::to_string(2 * bpp_) + " reserved, 0 pinned)"));
  EXPECT_EQ(Snap(), before) << "nothing matched or pinned";

  absl::StatusOr<MatchResult> two = Pin(b_, {1, 2});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_NE(two->pin_id, 0u);
  // A pin on pages a pin holds already adds nothing; one more page would.
  EXPECT_TRUE(Pin(b_, {1}).ok());
  EXPECT_EQ(Pin(b_, {1, 2, 3}).status().code(), absl::StatusCode::kResourceExhausted);
  // Nor may the reservation grow past the pins.
  EXPECT_EQ(index_->Reserve(small, bpp_, "globex").status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(index_->Release(b_, two->pin_id).ok());
  EXPECT_TRUE(index_->Reserve(small, bpp_, "globex").ok());
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, FairByDefaultLeavesAPoolATenantHasToItself) {
  Reset({});
  const PoolKey own{"gpu-2", Tier::kGpu};
  ASSERT_TRUE(index_->SetPoolCapacity(own, 8 * bpp_).ok());
  MustInsert(b_, {1, 2, 3, 4, 5, 6}, own);
  // Nobody else holds pages or a reservation here: globex may pin and reserve it all.
  ASSERT_TRUE(Pin(b_, {1, 2, 3, 4, 5, 6}).ok());
  ASSERT_TRUE(index_->Reserve(own, 2 * bpp_, "globex").ok());
  // The operators' reservations do not make a pool shared.
  ASSERT_TRUE(index_->SetPoolCapacity(own, 9 * bpp_).ok());
  ASSERT_TRUE(index_->Reserve(own, bpp_, "").ok());
  ASSERT_TRUE(index_->Unreserve(own, 2 * bpp_, "globex").ok());
  EXPECT_TRUE(index_->Reserve(own, 2 * bpp_, "globex").ok());
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, AClaimMadeAloneIsKeptButCannotGrowOnceThePoolIsShared) {
  Reset({});
  const PoolKey pool{"gpu-2", Tier::kGpu};
  ASSERT_TRUE(index_->SetPoolCapacity(pool, 8 * bpp_).ok());
  ASSERT_TRUE(index_->Reserve(pool, 6 * bpp_, "globex").ok());  // alone: no share
  MustInsert(a_, {1}, pool);                                    // now acme uses the pool
  EXPECT_EQ(Tenant("globex").reserved_bytes, 6 * bpp_) << "nothing is taken back";
  absl::StatusOr<uint64_t> more = index_->Reserve(pool, 1, "globex");
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), HasSubstr("default_tenant_pool_share_pct"));
  ASSERT_TRUE(index_->Unreserve(pool, 3 * bpp_, "globex").ok());
  EXPECT_TRUE(index_->Reserve(pool, bpp_, "globex").ok());  // 4 of 8: at the share
  EXPECT_EQ(index_->Reserve(pool, 1, "globex").status().code(),
            absl::StatusCode::kResourceExhausted);
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, WithTenantsConfiguredTheShareHoldsFromTheFirstByte) {
  // Issue 35: alone in a pool, globex reserved 90% of it and the next tenant found it
  // taken. With two tenants configured (the tokens file's), the share holds at once.
  Reset({});
  index_->SetConfiguredTenants(2);
  const PoolKey pool{"gpu-2", Tier::kGpu};
  ASSERT_TRUE(index_->SetPoolCapacity(pool, 10 * bpp_).ok());
  const Snapshot before = Snap();
  absl::StatusOr<uint64_t> most = index_->Reserve(pool, 9 * bpp_, "globex");
  EXPECT_EQ(most.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(most.status().message(), HasSubstr("default_tenant_pool_share_pct: tenant globex"));
  EXPECT_THAT(most.status().message(), HasSubstr("2 tenants are configured"));
  EXPECT_EQ(Snap(), before) << "nothing changed";
  // Pins count too: globex may not pin past its half of a pool nobody else uses.
  MustInsert(b_, {1, 2, 3, 4, 5, 6}, pool);
  EXPECT_EQ(Pin(b_, {1, 2, 3, 4, 5, 6}).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(index_->Reserve(pool, 5 * bpp_, "globex").ok());  // its share, no more
  EXPECT_EQ(index_->Reserve(pool, 1, "globex").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(index_->Reserve(pool, 5 * bpp_, "acme").ok()) << "the next tenant's half is there";
  // One tenant configured (or none: no tokens file): a pool it has to itself is its own.
  index_->SetConfiguredTenants(1);
  const PoolKey own{"gpu-3", Tier::kGpu};
  ASSERT_TRUE(index_->SetPoolCapacity(own, 10 * bpp_).ok());
  EXPECT_TRUE(index_->Reserve(own, 9 * bpp_, "globex").ok());
  ExpectConsistent();
}

TEST_F(CacheIndexQuotaTest, QuotasOrAHundredPercentReplaceTheDefaultShare) {
  for (const CacheIndexOptions& options :
       {CacheIndexOptions{.tenant_max_bytes = 100 * bpp_},
        CacheIndexOptions{.tenant_max_pinned_bytes = 100 * bpp_},
        CacheIndexOptions{.default_tenant_pool_share_pct = 100}}) {
    Reset(options);
    const PoolKey small{"gpu-2", Tier::kGpu};
    ASSERT_TRUE(index_->SetPoolCapacity(small, 16 * bpp_).ok());
    MustInsert(a_, {1}, small);
    EXPECT_TRUE(index_->Reserve(small, 15 * bpp_, "globex").ok());
    EXPECT_EQ(index_->Stats().default_tenant_pool_share_pct, 0u);
    EXPECT_EQ(PoolOf(small).tenant_share_bytes, 0u);
  }
}

TEST_F(CacheIndexQuotaTest, BadOptionsAreInvalidArgument) {
  for (uint32_t pct : {0u, 101u}) {
    absl::Status share = CacheIndexOptions{.default_tenant_pool_share_pct = pct}.Validate();
    EXPECT_EQ(share.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(share.message(), HasSubstr("default_tenant_pool_share_pct"));
  }
  EXPECT_THAT(CacheIndexOptions{.max_engine_pages_per_engine = 0}.Validate().message(),
              HasSubstr("max_engine_pages_per_engine"));
  EXPECT_THAT(CacheIndexOptions{.max_engine_pages_per_tenant = 0}.Validate().message(),
              HasSubstr("max_engine_pages_per_tenant"));
  absl::Status s =
      CacheIndexOptions{.tenant_max_bytes = 10, .tenant_max_pinned_bytes = 11}.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tenant_max_pinned_bytes"));
  EXPECT_TRUE(CacheIndexOptions{.tenant_max_pinned_bytes = 11}.Validate().ok());
  EXPECT_EQ(
      CacheIndex::Create({.tenant_max_bytes = 1, .tenant_max_pinned_bytes = 2}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// Two tenants, tight quotas, a few thousand random calls under every policy: the counters
// always equal what the tree holds, and no tenant ever holds more than its quota.
TEST_F(CacheIndexQuotaTest, RandomOperationsKeepTenantCountersConsistent) {
  for (const char* policy : {"lru", "cost", "adaptive", "density", "conversation", "select"}) {
    SCOPED_TRACE(policy);
    Reset({.policy = policy,
           .tenant_max_bytes = 12 * bpp_,
           .tenant_max_pinned_bytes = 8 * bpp_,
           .default_max_page_age = absl::Seconds(50)});
    std::mt19937 rng(11);
    const PoolKey pools[] = {gpu0_, gpu1_, {"gpu-0", Tier::kHost}};
    for (const PoolKey& p : pools) ASSERT_TRUE(index_->SetPoolCapacity(p, 16 * bpp_).ok());
    const NamespaceId* tenants[] = {&a_, &b_};
    std::vector<std::pair<NamespaceId, PinId>> pins;
    for (int step = 0; step < 2000; ++step) {
      const NamespaceId& ns = *tenants[rng() % 2];
      std::vector<int32_t> ids;
      const int len = 1 + rng() % 6;
      for (int i = 0; i < len; ++i) ids.push_back(rng() % 3);
      const PoolKey& pool = pools[rng() % 3];
      switch (rng() % 9) {
        case 0:
        case 1:
        case 2: {
          absl::StatusOr<InsertResult> r =
              Insert(ns, ids, pool, {.use_reservation = rng() % 2 == 0});
          ASSERT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kResourceExhausted)
              << r.status();
          break;
        }
        case 3: {
          absl::StatusOr<MatchResult> m = Pin(ns, ids, absl::Seconds(1 + rng() % 20));
          ASSERT_TRUE(m.ok() || m.status().code() == absl::StatusCode::kResourceExhausted)
              << m.status();
          if (m.ok() && m->pin_id != 0) pins.emplace_back(ns, m->pin_id);
          break;
        }
        case 4:
          if (!pins.empty()) {
            const size_t i = rng() % pins.size();
            absl::Status s = index_->Release(pins[i].first, pins[i].second);
            ASSERT_TRUE(s.ok() || s.code() == absl::StatusCode::kAborted ||
                        s.code() == absl::StatusCode::kNotFound)
                << s;
            pins.erase(pins.begin() + static_cast<std::ptrdiff_t>(i));
          }
          break;
        case 5: {
          const uint64_t bytes = (1 + rng() % 3) * bpp_;
          if (rng() % 2 == 0) {
            absl::StatusOr<uint64_t> r = index_->Reserve(pool, bytes, ns.tenant);
            ASSERT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kResourceExhausted)
                << r.status();
          } else {
            absl::Status s = index_->Unreserve(pool, bytes, ns.tenant);
            ASSERT_TRUE(s.ok() || s.code() == absl::StatusCode::kOutOfRange) << s;
          }
          break;
        }
        case 6:
          clock_.Advance(absl::Seconds(rng() % 10));
          index_->SweepExpired(1 + rng() % 8);
          break;
        case 7:
          if (rng() % 8 == 0) {
            ASSERT_TRUE(index_->DropPool(pool).ok());
          } else {
            index_->SweepRetired(1 + rng() % 4);
          }
          break;
        case 8: {
          const PoolStats p = PoolOf(pool);
          if (p.used_bytes > p.pinned_bytes) {
            ASSERT_TRUE(index_->EvictFromPool(pool, bpp_).ok());
          }
          break;
        }
      }
      absl::Status consistent = index_->CheckTenantAccounting();
      ASSERT_TRUE(consistent.ok()) << "step " << step << ": " << consistent;
      for (const TenantStats& t : index_->Stats().tenants) {
        ASSERT_LE(t.held_bytes(), 12 * bpp_) << t.tenant << " at step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace kvcm
