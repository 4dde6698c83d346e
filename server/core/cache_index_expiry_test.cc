// Retention: pages leave the index at their namespace's max page age (cache_index_expiry.cc),
// driven by a FakeClock.
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/cache_index.h"
#include "tests/util/match_replicas.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
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

class CacheIndexExpiryTest : public ::testing::Test {
 protected:
  void SetUp() override { Reset({}, absl::Minutes(60)); }

  // A fresh index with `options` (clock and secret filled in) and ns_ registered with
  // `ns_max_age`; events go to events_.
  void Reset(CacheIndexOptions options, absl::Duration ns_max_age) {
    options.clock = &clock_;
    options.hash_secret = HashKey{11, 22};
    index_ = std::make_unique<CacheIndex>(options);
    index_->SetEventListener([this](const CacheEvent& e) { events_.push_back(e); });
    ASSERT_TRUE(
        index_->RegisterModel(ns_, Mla(), CacheIndex::NamespaceSource::kClient, ns_max_age).ok());
  }

  std::vector<PageHash> Prompt(std::vector<int32_t> page_ids) {
    std::vector<int32_t> tokens;
    for (int32_t id : page_ids) tokens.insert(tokens.end(), kPage, id);
    return *index_->HashTokens(ns_, tokens);
  }

  static std::vector<BlockId> Blocks(uint32_t first, size_t n) {
    std::vector<BlockId> b(n);
    std::iota(b.begin(), b.end(), first);
    return b;
  }

  void MustInsert(const std::vector<PageHash>& pages, const PoolKey& pool, uint32_t first_block,
                  InsertOptions options = {}) {
    absl::StatusOr<InsertResult> r =
        index_->Insert(ns_, pages, pool, Blocks(first_block, pages.size()), options);
    EXPECT_TRUE(r.ok()) << r.status();
  }

  uint32_t Matched(const std::vector<PageHash>& pages, MatchOptions options = {}) {
    absl::StatusOr<MatchResult> r = index_->Match(ns_, pages, options);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->matched_pages : 0;
  }

  // Sweeps until a pass is over; the page-locations removed.
  uint64_t Sweep() {
    uint64_t expired = 0;
    ExpirySweepResult r;
    do {
      r = index_->SweepExpired(256);
      expired += r.expired_pages;
    } while (r.more);
    return expired;
  }

  // The kRemoved events with reason kExpired, as (pool, block ids).
  std::vector<std::pair<PoolKey, std::vector<BlockId>>> ExpiredEvents() const {
    std::vector<std::pair<PoolKey, std::vector<BlockId>>> out;
    for (const CacheEvent& e : events_) {
      if (e.kind == CacheEvent::Kind::kRemoved && e.reason == CacheEvent::Reason::kExpired) {
        out.emplace_back(e.pool, e.block_ids);
      }
    }
    return out;
  }

  const NamespaceStats& StatsOf(const IndexStats& s, const NamespaceId& ns) {
    for (const NamespaceStats& n : s.namespaces) {
      if (n.ns == ns) return n;
    }
    static NamespaceStats none;
    return none;
  }

  uint64_t PoolPages(const PoolKey& key) {
    for (const PoolStats& p : index_->Stats().pools) {
      if (p.pool == key) return p.pages;
    }
    return 0;
  }

  FakeClock clock_;
  NamespaceId ns_{"acme", "deepseek-v3"};
  PoolKey gpu0_{"gpu-0", Tier::kGpu};
  PoolKey gpu1_{"gpu-1", Tier::kGpu};
  std::vector<CacheEvent> events_;
  std::unique_ptr<CacheIndex> index_;
};

TEST_F(CacheIndexExpiryTest, PagesLeaveAtTheirAgeWithRemovedEventsAndTheCounter) {
  MustInsert(Prompt({1, 2, 3}), gpu0_, 100);
  EXPECT_EQ(Matched(Prompt({1, 2, 9})), 2u);  // splits the node: both halves must expire

  clock_.Advance(absl::Minutes(60) - absl::Milliseconds(1));
  EXPECT_EQ(Sweep(), 0u);
  EXPECT_EQ(Matched(Prompt({1, 2, 3})), 3u);

  clock_.Advance(absl::Milliseconds(1));  // age == limit: expired
  EXPECT_EQ(Sweep(), 3u);
  EXPECT_EQ(Matched(Prompt({1, 2, 3})), 0u);
  // Leaves first, so the agent frees the deepest block first; all of them with reason
  // kExpired (the agent gets FreeBlocks for them as for an eviction).
  EXPECT_THAT(ExpiredEvents(), ElementsAre(std::pair(gpu0_, std::vector<BlockId>{102}),
                                           std::pair(gpu0_, std::vector<BlockId>{100, 101})));
  const IndexStats s = index_->Stats();
  EXPECT_EQ(s.counters.expired_pages, 3u);
  EXPECT_EQ(s.counters.evicted_pages, 0u);
  EXPECT_EQ(StatsOf(s, ns_).expired_pages, 3u);
  EXPECT_EQ(StatsOf(s, ns_).max_page_age, absl::Minutes(60));
  EXPECT_EQ(StatsOf(s, ns_).page_locations, 0u);
  EXPECT_EQ(StatsOf(s, ns_).radix_nodes, 0u);
  EXPECT_EQ(PoolPages(gpu0_), 0u);
  EXPECT_EQ(Sweep(), 0u);
}

TEST_F(CacheIndexExpiryTest, AgeCountsFromTheCommitNotFromTheLastUse) {
  MustInsert(Prompt({1, 2}), gpu0_, 0);
  clock_.Advance(absl::Minutes(59));
  EXPECT_EQ(Matched(Prompt({1, 2})), 2u);
  MustInsert(Prompt({1, 2}), gpu0_, 0);  // already present: keeps its commit time
  clock_.Advance(absl::Minutes(1));
  EXPECT_EQ(Matched(Prompt({1, 2})), 0u);
  EXPECT_EQ(Sweep(), 2u);
}

TEST_F(CacheIndexExpiryTest, AMatchBetweenSweepsNeverReturnsAnExpiredPage) {
  MustInsert(Prompt({1, 2}), gpu0_, 0);
  clock_.Advance(absl::Minutes(30));
  MustInsert(Prompt({1, 2, 3, 4}), gpu0_, 0);  // pages 3 and 4 are 30 minutes younger
  clock_.Advance(absl::Minutes(30));

  // No sweep yet: pages 1 and 2 are past their age, so nothing matches, probe or not.
  EXPECT_EQ(Matched(Prompt({1, 2, 3, 4}), {.probe = true}), 0u);
  absl::StatusOr<MatchResult> pinned = index_->Match(ns_, Prompt({1, 2, 3, 4}), {.pin = true});
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(pinned->matched_pages, 0u);
  EXPECT_EQ(pinned->pin_id, 0u);
  // The younger pages leave with their prefix: a pool holds whole prefixes.
  EXPECT_EQ(Sweep(), 4u);
  EXPECT_EQ(StatsOf(index_->Stats(), ns_).page_locations, 0u);
}

TEST_F(CacheIndexExpiryTest, AnExpiredCopyEndsTheMatchUntilSweptThenTheYoungerCopyServes) {
  MustInsert(Prompt({1, 2}), gpu0_, 10);
  clock_.Advance(absl::Minutes(30));
  MustInsert(Prompt({1, 2}), gpu1_, 20);
  clock_.Advance(absl::Minutes(30));

  EXPECT_EQ(Matched(Prompt({1, 2})), 0u);  // a pin there would keep gpu-0's old copy
  EXPECT_EQ(Sweep(), 2u);
  EXPECT_THAT(ExpiredEvents(), ElementsAre(std::pair(gpu0_, std::vector<BlockId>{10, 11})));
  absl::StatusOr<MatchResult> m = index_->Match(ns_, Prompt({1, 2}), {});
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->matched_pages, 2u);
  ASSERT_EQ(m->segments.size(), 1u);
  ASSERT_EQ(ReplicasOf(*m, m->segments[0]).size(), 1u);
  EXPECT_EQ(*ReplicasOf(*m, m->segments[0])[0].pool, gpu1_);

  clock_.Advance(absl::Minutes(30));
  EXPECT_EQ(Sweep(), 2u);
  EXPECT_EQ(Matched(Prompt({1, 2})), 0u);
}

TEST_F(CacheIndexExpiryTest, PinnedPagesStayUntilReleasedAndAreNeitherRenewedNorPinnedAgain) {
  MustInsert(Prompt({1, 2}), gpu0_, 0);
  clock_.Advance(absl::Minutes(59));
  absl::StatusOr<MatchResult> pin =
      index_->Match(ns_, Prompt({1, 2}), {.pin = true, .lease_ttl = absl::Minutes(5)});
  ASSERT_TRUE(pin.ok());
  ASSERT_NE(pin->pin_id, 0u);
  clock_.Advance(absl::Minutes(1));

  EXPECT_EQ(Sweep(), 0u) << "a pinned page left before its pin ended";
  EXPECT_EQ(StatsOf(index_->Stats(), ns_).page_locations, 2u);
  // New callers see a miss and get no pin; the holder cannot extend its lease.
  absl::StatusOr<MatchResult> again = index_->Match(ns_, Prompt({1, 2}), {.pin = true});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->matched_pages, 0u);
  EXPECT_EQ(again->pin_id, 0u);
  absl::StatusOr<absl::Time> renewed = index_->RenewLease(ns_, pin->pin_id, absl::Minutes(5));
  EXPECT_EQ(renewed.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(renewed.status().message(), HasSubstr("max page age"));

  ASSERT_TRUE(index_->Release(ns_, pin->pin_id).ok());
  EXPECT_EQ(Sweep(), 2u);
  EXPECT_EQ(index_->Stats().counters.expired_pages, 2u);
}

TEST_F(CacheIndexExpiryTest, APinnedExpiredPageLeavesWhenItsLeaseLapses) {
  MustInsert(Prompt({1, 2}), gpu0_, 0);
  MustInsert(Prompt({5}), gpu0_, 7);  // unpinned: leaves on time, past the pinned entry
  clock_.Advance(absl::Minutes(59));
  ASSERT_NE(
      index_->Match(ns_, Prompt({1, 2}), {.pin = true, .lease_ttl = absl::Minutes(5)})->pin_id, 0u);
  clock_.Advance(absl::Minutes(1));
  EXPECT_EQ(Sweep(), 1u);
  clock_.Advance(absl::Minutes(4));
  EXPECT_EQ(Sweep(), 2u);  // the sweep expires the lapsed lease first
  EXPECT_EQ(index_->Stats().counters.lease_expiries, 1u);
}

TEST_F(CacheIndexExpiryTest, ANamespaceLimitOnlyTightensTheManagerDefault) {
  Reset({.default_max_page_age = absl::Seconds(100)}, absl::ZeroDuration());
  auto reg = [&](const NamespaceId& ns, int64_t s) {
    absl::StatusOr<RegisterModelResult> r =
        index_->RegisterModel(ns, Mla(), CacheIndex::NamespaceSource::kClient, absl::Seconds(s));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? absl::ToInt64Seconds(r->max_page_age) : -1;
  };
  EXPECT_EQ(reg(ns_, 0), 100);  // the default
  const NamespaceId b{"acme", "b"}, c{"acme", "c"};
  EXPECT_EQ(reg(b, 50), 50);
  EXPECT_EQ(reg(c, 200), 100);  // cannot pass the default
  // Registering again: a shorter limit lowers it, a longer one or 0 leaves it.
  EXPECT_EQ(reg(b, 80), 50);
  EXPECT_EQ(reg(b, 0), 50);
  EXPECT_EQ(reg(b, 20), 20);
  EXPECT_EQ(absl::ToInt64Seconds(index_->GetNamespace(b)->registered_max_page_age), 20);
  EXPECT_EQ(absl::ToInt64Seconds(index_->GetNamespace(c)->registered_max_page_age), 200);
  EXPECT_EQ(StatsOf(index_->Stats(), b).max_page_age, absl::Seconds(20));

  // Pages of ns_ follow the default.
  MustInsert(Prompt({1}), gpu0_, 0);
  clock_.Advance(absl::Seconds(99));
  EXPECT_EQ(Sweep(), 0u);
  clock_.Advance(absl::Seconds(1));
  EXPECT_EQ(Sweep(), 1u);
}

TEST_F(CacheIndexExpiryTest, NoLimitKeepsPagesForever) {
  Reset({}, absl::ZeroDuration());
  MustInsert(Prompt({1, 2}), gpu0_, 0);
  clock_.Advance(absl::Hours(24 * 365));
  EXPECT_EQ(Sweep(), 0u);
  EXPECT_EQ(Matched(Prompt({1, 2})), 2u);
  EXPECT_EQ(StatsOf(index_->Stats(), ns_).max_page_age, absl::ZeroDuration());
}

TEST_F(CacheIndexExpiryTest, ALimitSetLaterAppliesToPagesAlreadyCached) {
  Reset({}, absl::ZeroDuration());
  MustInsert(Prompt({1, 2}), gpu0_, 0);
  MustInsert(Prompt({1, 2, 3}), gpu1_, 0);
  clock_.Advance(absl::Hours(2));
  MustInsert(Prompt({4}), gpu0_, 9);
  ASSERT_TRUE(
      index_->RegisterModel(ns_, Mla(), CacheIndex::NamespaceSource::kClient, absl::Minutes(60))
          .ok());
  EXPECT_EQ(Matched(Prompt({1, 2, 3}), {.probe = true}), 0u);
  EXPECT_EQ(Sweep(), 5u);
  EXPECT_EQ(Matched(Prompt({4})), 1u);
}

// An engine's pages are the engine's to keep (TrackExpiry leaves them out), also when the
// namespace gets its limit after they were published: the queue must not hold them, or a
// node the engine's removal freed would be read by the next sweep.
TEST_F(CacheIndexExpiryTest, ALimitSetLaterLeavesAnEnginesPagesToTheEngine) {
  Reset({}, absl::ZeroDuration());
  const PoolKey engine{"vllm-0", Tier::kGpu};
  ASSERT_TRUE(index_->StoreEnginePages(ns_, Prompt({1, 2, 3}), engine).ok());
  MustInsert(Prompt({7}), gpu0_, 0);
  ASSERT_TRUE(
      index_->RegisterModel(ns_, Mla(), CacheIndex::NamespaceSource::kClient, absl::Minutes(60))
          .ok());
  // The engine drops its pages; no agent holds them, so their nodes go.
  absl::StatusOr<uint64_t> removed = index_->RemoveEnginePages(ns_, Prompt({1}), engine);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 3u);
  clock_.Advance(absl::Hours(2));
  EXPECT_EQ(Sweep(), 1u) << "only the agent's page expires";
  EXPECT_EQ(Matched(Prompt({7}), {.probe = true}), 0u);
  // A page the engine publishes again is the engine's, whatever its age.
  ASSERT_TRUE(index_->StoreEnginePages(ns_, Prompt({1, 2}), engine).ok());
  clock_.Advance(absl::Hours(2));
  EXPECT_EQ(Sweep(), 0u);
}

TEST_F(CacheIndexExpiryTest, AnAbsurdMaxAgeIsInvalidArgumentAndChangesNothing) {
  const absl::Duration absurd = absl::Seconds(int64_t{kMaxPageAgeS} + 1);
  const NamespaceId other{"acme", "other"};
  absl::StatusOr<RegisterModelResult> r =
      index_->RegisterModel(other, Mla(), CacheIndex::NamespaceSource::kClient, absurd);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("max_page_age_s"));
  EXPECT_EQ(index_->GetNamespace(other).status().code(), absl::StatusCode::kNotFound);
  r = index_->RegisterModel(ns_, Mla(), CacheIndex::NamespaceSource::kClient, -absl::Seconds(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->GetNamespace(ns_)->max_page_age, absl::Minutes(60));

  EXPECT_EQ(CacheIndexOptions{.default_max_page_age = absurd}.Validate().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      CacheIndexOptions{.default_max_page_age = absl::Seconds(kMaxPageAgeS)}.Validate().ok());
}

TEST_F(CacheIndexExpiryTest, AnInsertCountsAgeFromItsCommitTime) {
  MustInsert(Prompt({1, 2}), gpu0_, 0, {.committed_at = clock_.Now() - absl::Minutes(50)});
  MustInsert(Prompt({7}), gpu0_, 5, {.committed_at = clock_.Now() + absl::Hours(5)});  // now
  clock_.Advance(absl::Minutes(10));
  EXPECT_EQ(Sweep(), 2u);
  clock_.Advance(absl::Minutes(50));
  EXPECT_EQ(Sweep(), 1u);
}

TEST_F(CacheIndexExpiryTest, HostCopiesExpireWithTheAgeOfTheirData) {
  Reset({.policy = "cost"}, absl::Minutes(60));
  const PoolKey host{"gpu-0", Tier::kHost};
  const uint64_t page = Mla().BytesPerPage();
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 2 * page).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 8 * page).ok());
  MustInsert(Prompt({1, 2}), gpu0_, 0);
  clock_.Advance(absl::Minutes(30));
  MustInsert(Prompt({3, 4}), gpu0_, 2);  // demotes pages 1 and 2 to the host pool
  ASSERT_EQ(PoolPages(host), 2u);
  ASSERT_EQ(index_->Stats().counters.demoted_pages, 2u);

  clock_.Advance(absl::Minutes(30));  // the demoted copy is 60 minutes old
  EXPECT_EQ(Sweep(), 2u);
  EXPECT_EQ(PoolPages(host), 0u);
  EXPECT_EQ(PoolPages(gpu0_), 2u);
  ASSERT_EQ(ExpiredEvents().size(), 1u);
  EXPECT_EQ(ExpiredEvents()[0].first, host);

  // An expired GPU copy is not demoted: it leaves.
  clock_.Advance(absl::Minutes(30));
  MustInsert(Prompt({5, 6}), gpu0_, 4, {.committed_at = clock_.Now()});
  EXPECT_EQ(PoolPages(host), 0u);
}

TEST_F(CacheIndexExpiryTest, EachSweepStepIsBoundedAndThePassResumes) {
  for (int32_t i = 0; i < 10; ++i) MustInsert(Prompt({i}), gpu0_, i);
  MustInsert(Prompt({100, 101}), gpu0_, 50);
  clock_.Advance(absl::Minutes(55));
  ASSERT_NE(
      index_->Match(ns_, Prompt({100, 101}), {.pin = true, .lease_ttl = absl::Minutes(10)})->pin_id,
      0u);
  clock_.Advance(absl::Minutes(5));
  // Pinned entries are looked at but stay; the others leave in steps of at most 3.
  uint64_t expired = 0;
  int calls = 0;
  ExpirySweepResult r;
  do {
    r = index_->SweepExpired(3);
    EXPECT_LE(r.removed_replicas, 3u);
    expired += r.expired_pages;
    ++calls;
  } while (r.more && calls < 100);
  EXPECT_EQ(expired, 10u);
  EXPECT_GE(calls, 4);
  EXPECT_EQ(StatsOf(index_->Stats(), ns_).page_locations, 2u);
}

TEST_F(CacheIndexExpiryTest, EvictionsAreEventsWithReasonEvicted) {
  MustInsert(Prompt({1}), gpu0_, 0);
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 1).ok());
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_EQ(events_[0].reason, CacheEvent::Reason::kNone);  // kStored
  EXPECT_EQ(events_[1].kind, CacheEvent::Kind::kRemoved);
  EXPECT_EQ(events_[1].reason, CacheEvent::Reason::kEvicted);
}

}  // namespace
}  // namespace kvcm
