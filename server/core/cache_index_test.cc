#include "server/core/cache_index.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/match_replicas.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint32_t kPage = 4;  // tokens per page in these tests

ModelSpec Mla(uint32_t page = kPage) {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = page};
}

ModelSpec Gqa(uint32_t page = kPage) {
  return ModelSpec{.attention = AttentionKind::kGqa,
                   .num_layers = 80,
                   .num_heads = 64,
                   .num_kv_heads = 8,
                   .head_dim = 128,
                   .page_size_tokens = page};
}

class CacheIndexTest : public ::testing::Test {
 protected:
  void SetUp() override { Reset(CacheIndexOptions{}); }

  void Reset(CacheIndexOptions options) {
    options.clock = &clock_;
    options.hash_secret = HashKey{11, 22};
    index_ = std::make_unique<CacheIndex>(options);
    ASSERT_TRUE(index_->RegisterModel(ns_, Mla()).ok());
    bpp_ =
        options.policy == "lru-mha" ? Mla().MhaShapedBytesPerToken() * kPage : Mla().BytesPerPage();
  }

  void RunRandomOperations();

  // Pages of a prompt whose tokens are `prefix` repeated then `suffix`: equal arguments
  // give equal pages.
  std::vector<PageHash> Prompt(std::vector<int32_t> page_ids, const NamespaceId* ns = nullptr) {
    std::vector<int32_t> tokens;
    for (int32_t id : page_ids) tokens.insert(tokens.end(), kPage, id);
    return *index_->HashTokens(ns ? *ns : ns_, tokens);
  }

  static std::vector<BlockId> Blocks(uint32_t first, size_t n) {
    std::vector<BlockId> b(n);
    std::iota(b.begin(), b.end(), first);
    return b;
  }

  InsertResult MustInsert(const std::vector<PageHash>& pages, const PoolKey& pool,
                          uint32_t first_block = 0) {
    absl::StatusOr<InsertResult> r =
        index_->Insert(ns_, pages, pool, Blocks(first_block, pages.size()));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : InsertResult{};
  }

  MatchResult MustMatch(const std::vector<PageHash>& pages, MatchOptions opts = {}) {
    absl::StatusOr<MatchResult> r = index_->Match(ns_, pages, opts);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : MatchResult{};
  }

  const PoolStats& Pool(const IndexStats& s, const PoolKey& key) {
    for (const PoolStats& p : s.pools) {
      if (p.pool == key) return p;
    }
    static PoolStats none;
    return none;
  }

  // Everything a failed call must leave untouched.
  struct Snapshot {
    std::vector<std::tuple<std::string, uint64_t, uint64_t, uint64_t, uint64_t>> pools;
    std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> namespaces;
    uint64_t pins, inserted, evicted;
    bool operator==(const Snapshot&) const = default;
  };
  Snapshot Snap() {
    IndexStats s = index_->Stats();
    Snapshot snap{{}, {}, s.active_pins, s.counters.inserted_pages, s.counters.evicted_pages};
    for (const PoolStats& p : s.pools) {
      snap.pools.emplace_back(p.pool.ToString(), p.capacity_bytes, p.used_bytes, p.pinned_bytes,
                              p.pages);
    }
    for (const NamespaceStats& n : s.namespaces) {
      snap.namespaces.emplace_back(n.pages, n.page_locations, n.radix_nodes);
    }
    return snap;
  }

  FakeClock clock_;
  NamespaceId ns_{"acme", "deepseek-v3"};
  PoolKey gpu0_{"gpu-0", Tier::kGpu};
  PoolKey gpu1_{"gpu-1", Tier::kGpu};
  uint64_t bpp_ = 0;
  std::unique_ptr<CacheIndex> index_;
};

TEST_F(CacheIndexTest, MatchesLongestCachedPrefix) {
  MustInsert(Prompt({1, 2, 3, 4}), gpu0_, 100);
  MatchResult m = MustMatch(Prompt({1, 2, 3, 9, 9}));
  EXPECT_EQ(m.matched_pages, 3u);
  EXPECT_EQ(m.prompt_pages, 5u);
  ASSERT_EQ(m.segments.size(), 1u);
  EXPECT_EQ(m.segments[0].num_pages, 3u);
  ASSERT_EQ(ReplicasOf(m, m.segments[0]).size(), 1u);
  EXPECT_EQ(*ReplicasOf(m, m.segments[0])[0].pool, gpu0_);
  EXPECT_THAT(ReplicasOf(m, m.segments[0])[0].block_ids, ElementsAre(100, 101, 102));
  EXPECT_EQ(MustMatch(Prompt({2, 1})).matched_pages, 0u);
  EXPECT_EQ(MustMatch(Prompt({1, 2, 3, 4, 5, 6})).matched_pages, 4u);
}

TEST_F(CacheIndexTest, DivergingInsertSplitsTheNode) {
  MustInsert(Prompt({1, 2, 3, 4}), gpu0_, 0);
  InsertResult r = MustInsert(Prompt({1, 2, 7, 8}), gpu0_, 10);
  EXPECT_EQ(r.already_present_pages, 2u);
  EXPECT_THAT(r.existing_block_ids, ElementsAre(0, 1));
  EXPECT_EQ(r.new_pages, 2u);
  IndexStats s = index_->Stats();
  EXPECT_EQ(s.namespaces[0].radix_nodes, 3u);  // [1,2] -> {[3,4], [7,8]}
  EXPECT_EQ(s.namespaces[0].pages, 6u);

  MatchResult m = MustMatch(Prompt({1, 2, 7, 8}));
  EXPECT_EQ(m.matched_pages, 4u);
  ASSERT_EQ(m.segments.size(), 2u);
  EXPECT_THAT(ReplicasOf(m, m.segments[0])[0].block_ids, ElementsAre(0, 1));
  EXPECT_THAT(ReplicasOf(m, m.segments[1])[0].block_ids, ElementsAre(12, 13));
  EXPECT_EQ(m.segments[1].first_page, 2u);
}

TEST_F(CacheIndexTest, InsertIsIdempotent) {
  MustInsert(Prompt({1, 2, 3}), gpu0_);
  Snapshot before = Snap();
  InsertResult again = MustInsert(Prompt({1, 2, 3}), gpu0_, 50);
  EXPECT_EQ(again.already_present_pages, 3u);
  EXPECT_EQ(again.new_pages, 0u);
  EXPECT_THAT(again.existing_block_ids, ElementsAre(0, 1, 2));
  EXPECT_EQ(Snap(), before);
  // A shorter prefix of a cached prompt is also already present.
  EXPECT_EQ(MustInsert(Prompt({1, 2}), gpu0_).already_present_pages, 2u);
  EXPECT_EQ(Snap(), before);
}

TEST_F(CacheIndexTest, PagesCarryEveryLocation) {
  MustInsert(Prompt({1, 2, 3}), gpu0_, 0);
  InsertResult r = MustInsert(Prompt({1, 2}), gpu1_, 20);
  EXPECT_EQ(r.replicated_pages, 2u);
  EXPECT_EQ(r.new_pages, 0u);

  MatchResult m = MustMatch(Prompt({1, 2, 3}), {.requester_agent_id = "gpu-1"});
  EXPECT_EQ(m.matched_pages, 3u);
  EXPECT_EQ(m.local_pages, 2u);
  ASSERT_EQ(m.segments.size(), 2u);
  ASSERT_EQ(ReplicasOf(m, m.segments[0]).size(), 2u);
  EXPECT_EQ(*ReplicasOf(m, m.segments[0])[0].pool, gpu1_);  // requester first
  EXPECT_THAT(ReplicasOf(m, m.segments[0])[0].block_ids, ElementsAre(20, 21));
  EXPECT_THAT(ReplicasOf(m, m.segments[0])[1].block_ids, ElementsAre(0, 1));
  ASSERT_EQ(ReplicasOf(m, m.segments[1]).size(), 1u);
  EXPECT_EQ(*ReplicasOf(m, m.segments[1])[0].pool, gpu0_);

  IndexStats s = index_->Stats();
  EXPECT_EQ(Pool(s, gpu0_).used_bytes, 3 * bpp_);
  EXPECT_EQ(Pool(s, gpu1_).used_bytes, 2 * bpp_);
  EXPECT_EQ(s.namespaces[0].pages, 3u);
  EXPECT_EQ(s.namespaces[0].page_locations, 5u);

  // Dropping gpu-0's copy keeps the pages reachable through gpu-1.
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 3 * bpp_).ok());
  m = MustMatch(Prompt({1, 2, 3}));
  EXPECT_EQ(m.matched_pages, 2u);
  EXPECT_EQ(*ReplicasOf(m, m.segments[0])[0].pool, gpu1_);
}

TEST_F(CacheIndexTest, ProbeChangesNothing) {
  MustInsert(Prompt({1, 2, 3, 4}), gpu0_);
  MustInsert(Prompt({5, 6}), gpu0_);
  Snapshot before = Snap();
  IndexCounters counters = index_->Stats().counters;
  MatchResult m = MustMatch(Prompt({1, 2}), {.probe = true});
  EXPECT_EQ(m.matched_pages, 2u);
  EXPECT_EQ(m.pin_id, 0u);
  EXPECT_EQ(Snap(), before);  // no split, no pin
  EXPECT_EQ(index_->Stats().counters.match_requests, counters.match_requests);
  // No recency change: [1..4] is still older than [5,6] and goes first.
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 1).ok());
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 0u);
  EXPECT_EQ(MustMatch(Prompt({5, 6}), {.probe = true}).matched_pages, 2u);
}

TEST_F(CacheIndexTest, EvictionFollowsLruOrderLeavesFirst) {
  MustInsert(Prompt({1, 2}), gpu0_);     // t1
  MustInsert(Prompt({3}), gpu0_);        // t2
  MustInsert(Prompt({1, 2, 4}), gpu0_);  // t3: touches [1,2] and adds leaf [4]
  MustMatch(Prompt({3}));                // t4
  // Leaves: [4] (t3), [3] (t4). [1,2] is an inner node until [4] goes.
  EvictResult r = *index_->EvictFromPool(gpu0_, 1);
  EXPECT_EQ(r.evicted_pages, 1u);
  EXPECT_EQ(MustMatch(Prompt({1, 2, 4}), {.probe = true}).matched_pages, 2u);
  r = *index_->EvictFromPool(gpu0_, 1);  // now [1,2] (t3) before [3] (t4)
  EXPECT_EQ(r.evicted_pages, 2u);
  EXPECT_EQ(r.evicted_bytes, 2 * bpp_);
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 0u);
  EXPECT_EQ(MustMatch(Prompt({3}), {.probe = true}).matched_pages, 1u);
  EXPECT_EQ(index_->Stats().counters.evicted_pages, 3u);
}

TEST_F(CacheIndexTest, PinnedPagesAreNeverEvicted) {
  MustInsert(Prompt({1, 2, 3}), gpu0_);
  MustInsert(Prompt({7}), gpu0_);
  MatchResult m = MustMatch(Prompt({1, 2}), {.pin = true});
  ASSERT_NE(m.pin_id, 0u);
  IndexStats s = index_->Stats();
  EXPECT_EQ(Pool(s, gpu0_).pinned_bytes, 2 * bpp_);
  EXPECT_EQ(s.active_pins, 1u);

  // Only [3] and [7] are evictable; asking for more is refused and changes nothing.
  Snapshot before = Snap();
  absl::StatusOr<EvictResult> r = index_->EvictFromPool(gpu0_, 3 * bpp_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snap(), before);

  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 2 * bpp_).ok());
  EXPECT_EQ(MustMatch(Prompt({1, 2, 3}), {.probe = true}).matched_pages, 2u);

  ASSERT_TRUE(index_->Release(ns_, m.pin_id).ok());
  s = index_->Stats();
  EXPECT_EQ(Pool(s, gpu0_).pinned_bytes, 0u);
  EXPECT_EQ(s.active_pins, 0u);
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 2 * bpp_).ok());
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).used_bytes, 0u);
}

TEST_F(CacheIndexTest, LeaseExpiresWithTheClock) {
  MustInsert(Prompt({1, 2}), gpu0_);
  MatchResult m = MustMatch(Prompt({1, 2}), {.pin = true, .lease_ttl = absl::Seconds(10)});
  EXPECT_EQ(m.lease_expiry, clock_.Now() + absl::Seconds(10));
  clock_.Advance(absl::Seconds(6));
  absl::StatusOr<absl::Time> renewed = index_->RenewLease(ns_, m.pin_id, absl::Seconds(10));
  ASSERT_TRUE(renewed.ok());
  clock_.Advance(absl::Seconds(6));
  index_->ExpireLeases();
  EXPECT_EQ(index_->Stats().active_pins, 1u);  // renewed to t=16
  clock_.Advance(absl::Seconds(5));
  index_->ExpireLeases();
  IndexStats s = index_->Stats();
  EXPECT_EQ(s.active_pins, 0u);
  EXPECT_EQ(s.counters.lease_expiries, 1u);
  EXPECT_EQ(Pool(s, gpu0_).pinned_bytes, 0u);

  Snapshot before = Snap();
  EXPECT_EQ(index_->Release(ns_, m.pin_id).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(index_->RenewLease(ns_, m.pin_id, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(Snap(), before);
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 2 * bpp_).ok());  // no longer protected
}

TEST_F(CacheIndexTest, UnknownPinAndNamespaceAreNotFoundAndChangeNothing) {
  MustInsert(Prompt({1}), gpu0_);
  MatchResult m = MustMatch(Prompt({1}), {.pin = true});
  Snapshot before = Snap();
  EXPECT_EQ(index_->Release(ns_, m.pin_id + 100).code(), absl::StatusCode::kNotFound);
  NamespaceId other{"other", "deepseek-v3"};
  ASSERT_TRUE(index_->RegisterModel(other, Mla()).ok());
  before = Snap();
  // A pin of one namespace cannot be released through another.
  EXPECT_EQ(index_->Release(other, m.pin_id).code(), absl::StatusCode::kNotFound);
  NamespaceId ghost{"ghost", "m"};
  EXPECT_EQ(index_->Match(ghost, Prompt({1}), {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(index_->Insert(ghost, Prompt({1}), gpu0_, Blocks(0, 1)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(index_->HashTokens(ghost, std::vector<int32_t>(8)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Snap(), before);
  EXPECT_TRUE(index_->Release(ns_, m.pin_id).ok());
  EXPECT_EQ(index_->Release(ns_, m.pin_id).code(), absl::StatusCode::kNotFound);  // twice
}

TEST_F(CacheIndexTest, TenantsNeverMatchEachOther) {
  NamespaceId other{"tenant-b", "deepseek-v3"};
  ASSERT_TRUE(index_->RegisterModel(other, Mla()).ok());
  MustInsert(Prompt({1, 2}), gpu0_);
  std::vector<PageHash> theirs = Prompt({1, 2}, &other);  // same tokens, other tenant
  EXPECT_NE(theirs, Prompt({1, 2}));
  EXPECT_EQ(index_->Match(other, theirs, {})->matched_pages, 0u);
}

TEST_F(CacheIndexTest, EvictingMoreThanExistsIsOutOfRangeAndChangesNothing) {
  MustInsert(Prompt({1, 2}), gpu0_);
  Snapshot before = Snap();
  EXPECT_EQ(index_->EvictFromPool(gpu0_, 2 * bpp_ + 1).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(index_->EvictFromNamespace(ns_, 2 * bpp_ + 1).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(index_->EvictFromPool(PoolKey{"nobody", Tier::kGpu}, 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(index_->EvictFromPool(gpu0_, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Snap(), before);
}

TEST_F(CacheIndexTest, BadInsertArgumentsChangeNothing) {
  Snapshot before = Snap();
  std::vector<PageHash> pages = Prompt({1, 2});
  EXPECT_EQ(index_->Insert(ns_, pages, gpu0_, Blocks(0, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->Insert(ns_, {}, gpu0_, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->Match(ns_, pages, {.pin = true, .probe = true}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->Match(ns_, pages, {.pin = true, .lease_ttl = absl::Hours(5)}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Snap(), before);
}

TEST_F(CacheIndexTest, RegisterModelIsIdempotentAndRefusesAnotherSpec) {
  absl::StatusOr<RegisterModelResult> again = index_->RegisterModel(ns_, Mla());
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->hash_key, DeriveNamespaceKey(HashKey{11, 22}, "acme", "deepseek-v3"));
  absl::StatusOr<RegisterModelResult> other = index_->RegisterModel(ns_, Mla(/*page=*/64));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.status().message(), HasSubstr("page=4"));
  ModelSpec bad = Mla();
  bad.num_layers = 0;
  EXPECT_EQ(index_->RegisterModel({"x", "y"}, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->Stats().namespaces.size(), 1u);
}

TEST_F(CacheIndexTest, AReaderConfirmsAnExistingNamespaceOnly) {
  using Source = CacheIndex::NamespaceSource;
  absl::StatusOr<RegisterModelResult> read =
      index_->RegisterModel(ns_, Mla(), Source::kReader, absl::Seconds(5));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(read->created);
  EXPECT_EQ(read->hash_key, DeriveNamespaceKey(HashKey{11, 22}, "acme", "deepseek-v3"));
  EXPECT_EQ(read->max_page_age, absl::ZeroDuration()) << "a reader tightens no retention";
  EXPECT_EQ(index_->RegisterModel(ns_, Mla(/*page=*/64), Source::kReader).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<RegisterModelResult> absent =
      index_->RegisterModel({"acme", "other"}, Mla(), Source::kReader);
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(index_->Stats().namespaces.size(), 1u);
}

TEST_F(CacheIndexTest, BytesFollowTheModelNotTheTokenCount) {
  NamespaceId llama{"acme", "llama-3-70b"};
  ASSERT_TRUE(index_->RegisterModel(llama, Gqa()).ok());
  MustInsert(Prompt({1, 2}), gpu0_);
  std::vector<PageHash> lp = Prompt({1, 2}, &llama);
  ASSERT_TRUE(index_->Insert(llama, lp, gpu0_, Blocks(50, 2)).ok());
  const uint64_t mla_page = 70272ull * kPage, gqa_page = 327680ull * kPage;
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).used_bytes, 2 * mla_page + 2 * gqa_page);
  // Evicting the namespace frees that model's bytes only.
  EvictResult r = *index_->EvictFromNamespace(llama, 1);
  EXPECT_EQ(r.evicted_bytes, 2 * gqa_page);
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).used_bytes, 2 * mla_page);
}

TEST_F(CacheIndexTest, InsertEvictsExactlyTheShortfall) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 4 * bpp_).ok());
  MustInsert(Prompt({1}), gpu0_);
  MustInsert(Prompt({2}), gpu0_);
  MustInsert(Prompt({3}), gpu0_);
  // One page free; a two-page insert must evict exactly one page (the LRU one).
  InsertResult r = MustInsert(Prompt({4, 5}), gpu0_);
  EXPECT_EQ(r.evicted_bytes, bpp_);
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 0u);
  EXPECT_EQ(MustMatch(Prompt({2}), {.probe = true}).matched_pages, 1u);
  IndexStats s = index_->Stats();
  EXPECT_EQ(Pool(s, gpu0_).used_bytes, 4 * bpp_);
  EXPECT_EQ(s.counters.evicted_bytes, bpp_);
}

TEST_F(CacheIndexTest, InsertNeverEvictsItsOwnPrefix) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 3 * bpp_).ok());
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({9}), gpu0_);
  MustMatch(Prompt({9}));  // [1,2] is now the LRU leaf, but it is the prefix being extended
  InsertResult r = MustInsert(Prompt({1, 2, 3}), gpu0_);
  EXPECT_EQ(r.already_present_pages, 2u);
  EXPECT_EQ(r.evicted_bytes, bpp_);
  EXPECT_EQ(MustMatch(Prompt({1, 2, 3}), {.probe = true}).matched_pages, 3u);
  EXPECT_EQ(MustMatch(Prompt({9}), {.probe = true}).matched_pages, 0u);
}

TEST_F(CacheIndexTest, InsertThatCannotFitIsRefusedWithoutChange) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 3 * bpp_).ok());
  MustInsert(Prompt({1, 2}), gpu0_);
  MatchResult pin = MustMatch(Prompt({1, 2}), {.pin = true});
  Snapshot before = Snap();
  EXPECT_EQ(index_->Insert(ns_, Prompt({5, 6}), gpu0_, Blocks(0, 2)).status().code(),
            absl::StatusCode::kResourceExhausted);  // 2 pinned + 2 new > 3
  EXPECT_EQ(index_->Insert(ns_, Prompt({5, 6, 7, 8}), gpu0_, Blocks(0, 4)).status().code(),
            absl::StatusCode::kResourceExhausted);  // larger than the pool
  EXPECT_EQ(Snap(), before);
  ASSERT_TRUE(index_->Release(ns_, pin.pin_id).ok());
  EXPECT_TRUE(index_->Insert(ns_, Prompt({5, 6}), gpu0_, Blocks(0, 2)).ok());
}

TEST_F(CacheIndexTest, InsertSplitsItsPartlyMatchedNodeRatherThanRefuse) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 3 * bpp_).ok());
  MustInsert(Prompt({1, 2, 3}), gpu0_);  // one node, the pool is full
  // [1, 9] needs one page; the only evictable bytes are [2, 3], inside the node the new
  // prompt passes through. Pinning that whole node would refuse the insert.
  InsertResult r = MustInsert(Prompt({1, 9}), gpu0_);
  EXPECT_EQ(r.evicted_bytes, 2 * bpp_);
  EXPECT_EQ(MustMatch(Prompt({1, 9}), {.probe = true}).matched_pages, 2u);
  EXPECT_EQ(MustMatch(Prompt({1, 2}), {.probe = true}).matched_pages, 1u);
}

TEST_F(CacheIndexTest, ReservedHeadroomIsNotFreeAndEvictsExactlyTheShortfall) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 5 * bpp_).ok());
  MustInsert(Prompt({1}), gpu0_);
  MustInsert(Prompt({2}), gpu0_);
  MustInsert(Prompt({3}), gpu0_);
  // 2 pages free; reserving 3 evicts exactly 1 (the LRU page).
  absl::StatusOr<uint64_t> evicted = index_->Reserve(gpu0_, 3 * bpp_, ns_.tenant);
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_EQ(*evicted, bpp_);
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 0u);
  const PoolStats p = Pool(index_->Stats(), gpu0_);
  EXPECT_EQ(p.reserved_bytes, 3 * bpp_);
  EXPECT_EQ(p.used_bytes + p.reserved_bytes, p.capacity_bytes);

  // Another request's insert cannot eat the headroom: it evicts instead.
  EXPECT_EQ(MustInsert(Prompt({4}), gpu0_).evicted_bytes, bpp_);
  // The reserving request's own insert draws on it and evicts nothing.
  InsertResult own =
      *index_->Insert(ns_, Prompt({5, 6}), gpu0_, Blocks(0, 2), {.use_reservation = true});
  EXPECT_EQ(own.evicted_bytes, 0u);
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).reserved_bytes, bpp_);
  ASSERT_TRUE(index_->Unreserve(gpu0_, bpp_, ns_.tenant).ok());
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).reserved_bytes, 0u);
}

TEST_F(CacheIndexTest, ATenantsLivePinsAreCapped) {
  Reset(CacheIndexOptions{.max_pins_per_tenant = 2});
  MustInsert(Prompt({1}), gpu0_);
  const MatchResult a = MustMatch(Prompt({1}), {.pin = true});
  const MatchResult b = MustMatch(Prompt({1}), {.pin = true});
  const uint64_t matches = index_->Stats().counters.match_requests;
  absl::StatusOr<MatchResult> third = index_->Match(ns_, Prompt({1}), {.pin = true});
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("max_pins_per_tenant"));
  EXPECT_EQ(index_->Stats().counters.match_requests, matches) << "nothing was matched";
  // Probes and plain matches still work; another tenant's pins are its own.
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 1u);
  const NamespaceId other{"other", "m"};
  ASSERT_TRUE(index_->RegisterModel(other, Mla()).ok());
  ASSERT_TRUE(index_->Insert(other, Prompt({1}, &other), gpu0_, Blocks(5, 1)).ok());
  EXPECT_TRUE(index_->Match(other, Prompt({1}, &other), {.pin = true}).ok());
  // A released pin and an expired one both give their place back.
  ASSERT_TRUE(index_->Release(ns_, a.pin_id).ok());
  EXPECT_TRUE(index_->Match(ns_, Prompt({1}), {.pin = true, .lease_ttl = absl::Seconds(1)}).ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_TRUE(index_->Match(ns_, Prompt({1}), {.pin = true}).ok());
  ASSERT_TRUE(index_->Release(ns_, b.pin_id).ok());
}

TEST_F(CacheIndexTest, AnInsertRefusedForReservedSpaceSaysSo) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 2 * bpp_).ok());
  ASSERT_TRUE(index_->Reserve(gpu0_, 2 * bpp_, ns_.tenant).ok());  // the whole pool, nothing pinned
  absl::StatusOr<InsertResult> r = index_->Insert(ns_, Prompt({1}), gpu0_, Blocks(0, 1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("0 bytes pinned"));
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat(2 * bpp_, " reserved by Reserve")));
}

TEST_F(CacheIndexTest, ReserveErrorsChangeNothing) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 3 * bpp_).ok());
  MustInsert(Prompt({1, 2}), gpu0_);
  MatchResult pin = MustMatch(Prompt({1, 2}), {.pin = true});
  Snapshot before = Snap();
  EXPECT_EQ(index_->Reserve(gpu0_, 2 * bpp_, ns_.tenant).status().code(),
            absl::StatusCode::kResourceExhausted);  // 2 pinned + 2 > 3
  EXPECT_EQ(index_->Reserve(gpu1_, 1, ns_.tenant).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(index_->Reserve(gpu0_, 0, ns_.tenant).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->Unreserve(gpu0_, 1, ns_.tenant).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Snap(), before);
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).reserved_bytes, 0u);
  ASSERT_TRUE(index_->Release(ns_, pin.pin_id).ok());
}

TEST_F(CacheIndexTest, PoolSharedByTwoModelsEvictsTheShortfallInBytes) {
  NamespaceId llama{"acme", "llama-3-70b"};
  ASSERT_TRUE(index_->RegisterModel(llama, Gqa()).ok());
  const uint64_t gqa_page = Gqa().BytesPerPage();        // ~4.7 MLA pages
  const uint64_t capacity = gqa_page + bpp_ + bpp_ / 2;  // ~6.2 MLA pages
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, capacity).ok());
  for (int32_t id = 1; id <= 6; ++id) MustInsert(Prompt({id}), gpu0_);  // 6 MLA pages
  // One GQA page is short of gqa_page - free bytes (4.5 MLA pages): 5 pages go, no more.
  const uint64_t free = capacity - 6 * bpp_;
  const uint64_t want = (gqa_page - free + bpp_ - 1) / bpp_;
  ASSERT_EQ(want, 5u);
  absl::StatusOr<InsertResult> r = index_->Insert(llama, Prompt({1}, &llama), gpu0_, Blocks(0, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->evicted_bytes, want * bpp_);
  const PoolStats p = Pool(index_->Stats(), gpu0_);
  EXPECT_EQ(p.used_bytes, (6 - want) * bpp_ + gqa_page);
  EXPECT_LE(p.used_bytes, p.capacity_bytes);
}

TEST_F(CacheIndexTest, UnknownPoolIsRefusedWhenDefaultCapacityIsZero) {
  Reset(CacheIndexOptions{.default_pool_capacity_bytes = 0});
  Snapshot before = Snap();
  EXPECT_EQ(index_->Insert(ns_, Prompt({1}), gpu0_, Blocks(0, 1)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Snap(), before);
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 10 * bpp_).ok());
  EXPECT_TRUE(index_->Insert(ns_, Prompt({1}), gpu0_, Blocks(0, 1)).ok());
}

TEST_F(CacheIndexTest, CountsEvictionRegret) {
  MustInsert(Prompt({1, 2}), gpu0_);
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 2 * bpp_).ok());
  MustMatch(Prompt({1, 2, 3}));
  EXPECT_EQ(index_->Stats().counters.eviction_regret_pages, 2u);
  MustMatch(Prompt({1, 2, 3}));  // counted once per eviction
  EXPECT_EQ(index_->Stats().counters.eviction_regret_pages, 2u);
}

TEST_F(CacheIndexTest, EventsReportStoredAndRemovedPages) {
  std::vector<CacheEvent> events;
  index_->SetEventListener([&](const CacheEvent& e) { events.push_back(e); });
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({1, 2, 3}), gpu0_);
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 1).ok());
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, CacheEvent::Kind::kStored);
  EXPECT_EQ(events[0].pages.size(), 2u);
  EXPECT_EQ(events[1].pages.size(), 1u);  // only the new page
  EXPECT_EQ(events[2].kind, CacheEvent::Kind::kRemoved);
  EXPECT_EQ(events[2].pages, std::vector<PageHash>{Prompt({1, 2, 3})[2]});
  EXPECT_EQ(events[2].pool, gpu0_);
  EXPECT_EQ(events[2].ns, ns_);
  EXPECT_TRUE(events[0].block_ids.empty());
}

TEST_F(CacheIndexTest, RemovedEventCarriesTheEvictedBlockIds) {
  std::vector<CacheEvent> events;
  index_->SetEventListener([&](const CacheEvent& e) { events.push_back(e); });
  ASSERT_TRUE(index_->Insert(ns_, Prompt({1, 2, 3}), gpu0_, std::vector<BlockId>{7, 4, 9}).ok());
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 3 * bpp_).ok());
  std::vector<BlockId> removed;
  for (const CacheEvent& e : events) {
    if (e.kind != CacheEvent::Kind::kRemoved) continue;
    EXPECT_EQ(e.block_ids.size(), e.pages.size());
    removed.insert(removed.end(), e.block_ids.begin(), e.block_ids.end());
  }
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<BlockId>{4, 7, 9}));
}

// Random operations across pools, pins and evictions; after each step the accounting must
// add up: used bytes == pages * bytes_per_page, pinned <= used <= capacity, and the pool
// totals equal the namespace's page-locations.
TEST_F(CacheIndexTest, ByteBlindArmChargesMhaShapedBytes) {
  Reset(CacheIndexOptions{.policy = "lru-mha"});
  MustInsert(Prompt({1, 2}), gpu0_);
  // DeepSeek-V3: 81,920 B per token and layer in an MHA-shaped cache, 71x the latent.
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).used_bytes, 2ull * kPage * 81920 * 61);
}

TEST_F(CacheIndexTest, OptNeedsAnOracle) {
  CacheIndexOptions options{.policy = "opt"};
  EXPECT_EQ(CacheIndex::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.policy = "belady";
  EXPECT_THAT(CacheIndex::Create(options).status().message(),
              HasSubstr("lru, lru-mha, cost, adaptive, density, conversation, opt, opt-whether"));
}

// Next uses set by the test, by first page.
class TableOracle final : public NextUseOracle {
 public:
  uint64_t NextUse(const PageHash& page) const override {
    auto it = next.find(page);
    return it == next.end() ? std::numeric_limits<uint64_t>::max() : it->second;
  }
  absl::flat_hash_map<PageHash, uint64_t> next;
};

TEST_F(CacheIndexTest, OptEvictsWhatIsNeededLast) {
  TableOracle oracle;
  Reset(CacheIndexOptions{.policy = "opt", .next_use = &oracle});
  std::vector<PageHash> a = Prompt({1}), b = Prompt({2}), c = Prompt({3});
  oracle.next = {{a[0], 50}, {b[0], 10}, {c[0], 30}};
  MustInsert(a, gpu0_);
  MustInsert(b, gpu0_);
  MustInsert(c, gpu0_);
  // LRU would take a (oldest); Belady takes a too (needed at 50), then c (30), then b.
  EXPECT_EQ(index_->EvictFromPool(gpu0_, 1)->evicted_pages, 1u);
  EXPECT_EQ(MustMatch(a, {.probe = true}).matched_pages, 0u);
  oracle.next[b[0]] = 70;  // b is touched now, and its next use moves past c's
  MustMatch(b);
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 1).ok());
  EXPECT_EQ(MustMatch(b, {.probe = true}).matched_pages, 0u);
  EXPECT_EQ(MustMatch(c, {.probe = true}).matched_pages, 1u);
}

TEST_F(CacheIndexTest, CostAwareKeepsFrequentlyReusedPrefixes) {
  for (const char* policy : {"lru", "cost"}) {
    SCOPED_TRACE(policy);
    Reset(CacheIndexOptions{.policy = policy});
    MustInsert(Prompt({1}), gpu0_);  // a shared prefix, reused many times
    for (int i = 0; i < 5; ++i) MustMatch(Prompt({1}));
    MustInsert(Prompt({2}), gpu0_);  // a one-off, newer
    ASSERT_TRUE(index_->EvictFromPool(gpu0_, 1).ok());
    const bool kept_shared = MustMatch(Prompt({1}), {.probe = true}).matched_pages == 1;
    // LRU drops the older page however often it was used; cost keeps it.
    EXPECT_EQ(kept_shared, std::string(policy) == "cost");
  }
}

TEST_F(CacheIndexTest, CostAwareDropsACopyBeforeAnOnlyCopy) {
  Reset(CacheIndexOptions{.policy = "cost"});
  MustInsert(Prompt({1}), gpu0_);
  MustInsert(Prompt({1}), gpu1_);  // [1] has two copies
  MustInsert(Prompt({2}), gpu0_);  // [2] only lives on gpu-0
  MustMatch(Prompt({2}));
  MustMatch(Prompt({1}));  // [1] is the more recent and as often used
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 1).ok());
  MatchResult m = MustMatch(Prompt({1}), {.probe = true});
  ASSERT_EQ(m.matched_pages, 1u);
  EXPECT_EQ(*ReplicasOf(m, m.segments[0])[0].pool, gpu1_);  // gpu-0's copy went
  EXPECT_EQ(MustMatch(Prompt({2}), {.probe = true}).matched_pages, 1u);
}

TEST_F(CacheIndexTest, NamespaceCountsAreCappedForClientsNotForAgents) {
  Reset(CacheIndexOptions{.max_namespaces = 4, .max_namespaces_per_tenant = 2});
  // ns_ is acme's first namespace.
  ASSERT_TRUE(index_->RegisterModel({"acme", "m2"}, Mla()).ok());
  absl::StatusOr<RegisterModelResult> third = index_->RegisterModel({"acme", "m3"}, Mla());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("max_namespaces_per_tenant"));
  EXPECT_EQ(index_->GetNamespace({"acme", "m3"}).status().code(), absl::StatusCode::kNotFound);
  // Confirming an existing one is not creating one.
  EXPECT_TRUE(index_->RegisterModel({"acme", "m2"}, Mla()).ok());
  ASSERT_TRUE(index_->RegisterModel({"u", "m"}, Mla()).ok());
  ASSERT_TRUE(index_->RegisterModel({"v", "m"}, Mla()).ok());  // the fourth in all
  absl::StatusOr<RegisterModelResult> fifth = index_->RegisterModel({"w", "m"}, Mla());
  EXPECT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(fifth.status().message(), HasSubstr("max_namespaces:"));
  EXPECT_EQ(index_->Stats().namespaces.size(), 4u);
  // What an agent's inventory holds is rebuilt whatever the count.
  EXPECT_TRUE(
      index_->RegisterModel({"acme", "m3"}, Mla(), CacheIndex::NamespaceSource::kInventory).ok());
  EXPECT_TRUE(
      index_->RegisterModel({"w", "m"}, Mla(), CacheIndex::NamespaceSource::kInventory).ok());
  EXPECT_EQ(index_->Stats().namespaces.size(), 6u);
}

TEST_F(CacheIndexTest, CostAwareDropsACopyFirstHoweverHotItIs) {
  Reset(CacheIndexOptions{.policy = "cost"});
  MustInsert(Prompt({4}), gpu1_, 40);  // the oldest page of gpu-1, its only copy
  clock_.Advance(absl::Seconds(60));
  MustInsert(Prompt({2}), gpu0_, 20);  // old, never reused, gpu-0's only copy
  clock_.Advance(absl::Seconds(60));
  MustInsert(Prompt({1}), gpu0_, 10);
  MustInsert(Prompt({1}), gpu1_, 11);  // [1] has two copies, and is hot
  for (int i = 0; i < 5; ++i) MustMatch(Prompt({1}));
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 1).ok());
  MatchResult m = MustMatch(Prompt({1}), {.probe = true});
  ASSERT_EQ(m.matched_pages, 1u);
  ASSERT_EQ(ReplicasOf(m, m.segments[0]).size(), 1u);
  EXPECT_EQ(*ReplicasOf(m, m.segments[0])[0].pool, gpu1_);  // gpu-0's copy went, not [2]
  EXPECT_EQ(MustMatch(Prompt({2}), {.probe = true}).matched_pages, 1u);
  // gpu-1's [1] is the only copy now: it is scored as one, so the older [4] goes first.
  ASSERT_TRUE(index_->EvictFromPool(gpu1_, 1).ok());
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 1u);
  EXPECT_EQ(MustMatch(Prompt({4}), {.probe = true}).matched_pages, 0u);
}

TEST_F(CacheIndexTest, CostAwareTrimsTheVictimToTheShortfall) {
  Reset(CacheIndexOptions{.policy = "cost"});
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 4 * bpp_).ok());
  MustInsert(Prompt({1, 2, 3}), gpu0_);
  MustInsert(Prompt({9}), gpu0_);
  InsertResult r = MustInsert(Prompt({7}), gpu0_);  // one page short
  EXPECT_EQ(r.evicted_bytes, bpp_);                 // lru would free all of [1, 2, 3]
  EXPECT_EQ(MustMatch(Prompt({1, 2, 3}), {.probe = true}).matched_pages, 2u);
}

TEST_F(CacheIndexTest, CostAwareRemembersReuseAcrossAnEviction) {
  Reset(CacheIndexOptions{.policy = "cost"});
  MustInsert(Prompt({5}), gpu0_);
  for (int i = 0; i < 3; ++i) MustMatch(Prompt({5}));
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, bpp_).ok());
  MustMatch(Prompt({5}));          // a miss on a page evicted moments ago
  MustInsert(Prompt({5}), gpu0_);  // back, with its earlier hits
  MustInsert(Prompt({6}), gpu0_);  // newer, but never reused
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, bpp_).ok());
  EXPECT_EQ(MustMatch(Prompt({5}), {.probe = true}).matched_pages, 1u);
  EXPECT_EQ(MustMatch(Prompt({6}), {.probe = true}).matched_pages, 0u);
}

TEST_F(CacheIndexTest, CostAwareDemotesToTheAgentsHostPool) {
  Reset(CacheIndexOptions{.policy = "cost"});
  const PoolKey host{"gpu-0", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 3 * bpp_).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 10 * bpp_).ok());
  MustInsert(Prompt({1}), gpu0_);
  MustInsert(Prompt({1, 2}), gpu0_);  // [1] -> [2]
  MustInsert(Prompt({5}), gpu0_);
  MustMatch(Prompt({5}));  // [5] is reused; leaf [2] goes first
  InsertResult r = MustInsert(Prompt({7}), gpu0_);
  EXPECT_EQ(r.evicted_bytes, bpp_);

  // [2] moved to the host pool, with the prefix [1] the host pool lacked.
  IndexStats s = index_->Stats();
  EXPECT_EQ(Pool(s, host).used_bytes, 2 * bpp_);
  EXPECT_EQ(Pool(s, gpu0_).used_bytes, 3 * bpp_);
  EXPECT_EQ(s.counters.demoted_pages, 1u);
  MatchResult m = MustMatch(Prompt({1, 2}), {.probe = true});
  ASSERT_EQ(m.matched_pages, 2u);
  ASSERT_EQ(m.segments.size(), 2u);
  EXPECT_EQ(ReplicasOf(m, m.segments[0]).size(), 2u);  // [1]: GPU and host
  ASSERT_EQ(ReplicasOf(m, m.segments[1]).size(), 1u);  // [2]: host only, block not yet known
  EXPECT_EQ(*ReplicasOf(m, m.segments[1])[0].pool, host);
  EXPECT_THAT(ReplicasOf(m, m.segments[1])[0].block_ids, ElementsAre(kPendingBlock));
}

TEST_F(CacheIndexTest, LruBaselineNeverDemotes) {
  const PoolKey host{"gpu-0", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 1 * bpp_).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 10 * bpp_).ok());
  MustInsert(Prompt({1}), gpu0_);
  MustInsert(Prompt({2}), gpu0_);
  EXPECT_EQ(Pool(index_->Stats(), host).used_bytes, 0u);
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 0u);
}

TEST_F(CacheIndexTest, DemotionNeedsRoomOrDropsThePage) {
  for (const char* policy : {"lru", "cost"}) {
    SCOPED_TRACE(policy);
    Reset(CacheIndexOptions{.policy = policy});
    const PoolKey host{"gpu-0", Tier::kHost};
    ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 1 * bpp_).ok());
    ASSERT_TRUE(index_->SetPoolCapacity(host, 1 * bpp_).ok());
    MustInsert(Prompt({9}), host);
    MatchResult pin = MustMatch(Prompt({9}), {.pin = true});  // the host pool is all pinned
    MustInsert(Prompt({1}), gpu0_);
    MustInsert(Prompt({2}), gpu0_);  // evicts [1]: lru drops it; cost finds no host room
    EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 0u);
    EXPECT_EQ(index_->Stats().counters.demoted_pages, 0u);
    ASSERT_TRUE(index_->Release(ns_, pin.pin_id).ok());
  }
}

// A demotion never evicts a HOST page an earlier demotion placed and the agent has not
// acknowledged yet (its blocks still pending): the agent's HOST pool would be short of the
// block that page is about to get, the DemoteBlocks would fail, and pages would stay
// indexed with no block. The GPU victim leaves instead; once acknowledged, the pending
// pages are evictable again.
TEST_F(CacheIndexTest, DemotionNeverEvictsPagesStillPendingInTheHostPool) {
  Reset(CacheIndexOptions{.policy = "cost"});
  const PoolKey host{"gpu-0", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 1 * bpp_).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 1 * bpp_).ok());
  MustInsert(Prompt({1}), gpu0_);
  MustInsert(Prompt({2}), gpu0_);  // demotes [1] into the host pool: pending
  MustInsert(Prompt({3}), gpu0_);  // [2] cannot take [1]'s place: it leaves
  EXPECT_EQ(index_->Stats().counters.demoted_pages, 1u);
  EXPECT_EQ(MustMatch(Prompt({2}), {.probe = true}).matched_pages, 0u);
  const std::vector<PageHash> one = Prompt({1});
  absl::StatusOr<std::vector<BlockId>> unassigned =
      index_->AssignBlocks(ns_, one, 0, host, std::vector<BlockId>{7});
  ASSERT_TRUE(unassigned.ok()) << unassigned.status();
  EXPECT_TRUE(unassigned->empty()) << "the pending page was evicted before its ack";
  MustInsert(Prompt({4}), gpu0_);  // demotes [3], evicting the acknowledged [1]
  EXPECT_EQ(index_->Stats().counters.demoted_pages, 2u);
  EXPECT_EQ(MustMatch(one, {.probe = true}).matched_pages, 0u);
}

TEST_F(CacheIndexTest, DemotionEventNamesTheSourceBlocksAndThePath) {
  Reset(CacheIndexOptions{.policy = "cost"});
  const PoolKey host{"gpu-0", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 3 * bpp_).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 10 * bpp_).ok());
  ASSERT_TRUE(index_->Insert(ns_, Prompt({1}), host, std::vector<BlockId>{40}).ok());
  ASSERT_TRUE(index_->Insert(ns_, Prompt({1, 2, 3}), gpu0_, std::vector<BlockId>{7, 8, 9}).ok());
  std::vector<CacheEvent> events;
  index_->SetEventListener([&](const CacheEvent& e) { events.push_back(e); });
  ASSERT_TRUE(index_->EvictFromPool(gpu0_, 2 * bpp_).ok());  // [2, 3] leave the GPU pool

  ASSERT_GE(events.size(), 2u);
  const CacheEvent& stored = events[0];
  EXPECT_EQ(stored.kind, CacheEvent::Kind::kStored);
  EXPECT_EQ(stored.pool, host);
  ASSERT_TRUE(stored.demoted_from.has_value());
  EXPECT_EQ(*stored.demoted_from, gpu0_);
  const std::vector<PageHash> all = Prompt({1, 2, 3});
  EXPECT_EQ(stored.prefix, std::vector<PageHash>{all[0]});  // the host pool had [1]
  EXPECT_EQ(stored.pages, std::vector<PageHash>(all.begin() + 1, all.end()));
  EXPECT_THAT(stored.source_block_ids, ElementsAre(8, 9));
  // The GPU blocks are freed only after the copy command was emitted.
  std::vector<BlockId> removed;
  for (size_t i = 1; i < events.size(); ++i) {
    EXPECT_EQ(events[i].kind, CacheEvent::Kind::kRemoved);
    EXPECT_EQ(events[i].pool, gpu0_);
    removed.insert(removed.end(), events[i].block_ids.begin(), events[i].block_ids.end());
  }
  std::sort(removed.begin(), removed.end());
  EXPECT_THAT(removed, ElementsAre(8, 9));
}

TEST_F(CacheIndexTest, AssignBlocksFillsPendingHostBlocksOnce) {
  Reset(CacheIndexOptions{.policy = "cost"});
  const PoolKey host{"gpu-0", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 2 * bpp_).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 10 * bpp_).ok());
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({5}), gpu0_);  // demotes [2] with its prefix [1]
  const std::vector<PageHash> path = Prompt({1, 2});
  MatchResult before = MustMatch(path, {.probe = true});
  ASSERT_EQ(ReplicasOf(before, before.segments.back()).size(), 1u);
  EXPECT_THAT(ReplicasOf(before, before.segments.back())[0].block_ids, ElementsAre(kPendingBlock));

  const Snapshot untouched = Snap();
  // Wrong count or a pending id: INVALID_ARGUMENT, nothing assigned.
  EXPECT_EQ(index_->AssignBlocks(ns_, path, 0, host, std::vector<BlockId>{1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->AssignBlocks(ns_, path, 0, host, std::vector<BlockId>{1, kPendingBlock})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->AssignBlocks(ns_, path, 0, {"nobody", Tier::kHost}, std::vector<BlockId>{1, 2})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Snap(), untouched);
  const MatchResult pending = MustMatch(path, {.probe = true});
  EXPECT_THAT(ReplicasOf(pending, pending.segments.back())[0].block_ids,
              ElementsAre(kPendingBlock));

  absl::StatusOr<std::vector<BlockId>> left =
      index_->AssignBlocks(ns_, path, 0, host, std::vector<BlockId>{30, 31});
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty());
  MatchResult after = MustMatch(path, {.probe = true});
  EXPECT_EQ(*ReplicasOf(after, after.segments[1])[0].pool, host);
  EXPECT_THAT(ReplicasOf(after, after.segments[1])[0].block_ids, ElementsAre(31));
  // A second answer for the same pages finds nothing pending: all its ids come back.
  left = index_->AssignBlocks(ns_, path, 0, host, std::vector<BlockId>{50, 51});
  ASSERT_TRUE(left.ok());
  EXPECT_THAT(*left, ElementsAre(50, 51));
  // Pages that left the host pool meanwhile give their ids back too.
  ASSERT_TRUE(index_->EvictFromPool(host, 2 * bpp_).ok());
  left = index_->AssignBlocks(ns_, path, 1, host, std::vector<BlockId>{60});
  ASSERT_TRUE(left.ok());
  EXPECT_THAT(*left, ElementsAre(60));
}

TEST_F(CacheIndexTest, AbandonPendingUndoesAFailedDemotion) {
  Reset(CacheIndexOptions{.policy = "cost"});
  const PoolKey host{"gpu-0", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 2 * bpp_).ok());
  ASSERT_TRUE(index_->SetPoolCapacity(host, 10 * bpp_).ok());
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({5}), gpu0_);  // demotes [1, 2] into the host pool, pending
  const std::vector<PageHash> path = Prompt({1, 2});
  ASSERT_EQ(Pool(index_->Stats(), host).used_bytes, 2 * bpp_);

  // Pinned: stays pending. Errors change nothing.
  MatchResult pin = MustMatch(path, {.pin = true});
  absl::StatusOr<uint64_t> removed = index_->AbandonPending(ns_, path, 0, host);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 0u);
  EXPECT_EQ(index_->AbandonPending(ns_, path, 3, host).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->AbandonPending(ns_, path, 0, {"nobody", Tier::kHost}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Pool(index_->Stats(), host).used_bytes, 2 * bpp_);
  ASSERT_TRUE(index_->Release(ns_, pin.pin_id).ok());

  std::vector<CacheEvent> events;
  index_->SetEventListener([&](const CacheEvent& e) { events.push_back(e); });
  removed = index_->AbandonPending(ns_, path, 0, host);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 2u);
  EXPECT_EQ(Pool(index_->Stats(), host).used_bytes, 0u);
  ASSERT_FALSE(events.empty());
  for (const CacheEvent& e : events) {
    EXPECT_EQ(e.kind, CacheEvent::Kind::kRemoved);
    for (BlockId b : e.block_ids) EXPECT_EQ(b, kPendingBlock);  // nothing for the agent to free
  }
  EXPECT_EQ(MustMatch(Prompt({5}), {.probe = true}).matched_pages, 1u);  // the GPU pages stay

  // Blocks that were assigned are never taken back.
  MustInsert(Prompt({1, 2}), gpu0_);  // demotes [5]
  const std::vector<PageHash> five = Prompt({5});
  ASSERT_TRUE(index_->AssignBlocks(ns_, five, 0, host, std::vector<BlockId>{9}).ok());
  removed = index_->AbandonPending(ns_, five, 0, host);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 0u);
  EXPECT_EQ(Pool(index_->Stats(), host).used_bytes, bpp_);
}

TEST_F(CacheIndexTest, DropPoolForgetsThePoolAtOnceAndTheSweepFreesTheTree) {
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({1, 2, 3}), gpu1_);
  MustInsert(Prompt({4}), gpu0_);
  MatchResult shared = MustMatch(Prompt({1, 2}), {.pin = true});  // gpu1 holds it too
  MatchResult only = MustMatch(Prompt({4}), {.pin = true});       // gpu0 only
  ASSERT_TRUE(index_->Reserve(gpu0_, bpp_, ns_.tenant).ok());
  std::vector<CacheEvent> events;
  index_->SetEventListener([&](const CacheEvent& e) { events.push_back(e); });

  absl::StatusOr<DropPoolResult> r = index_->DropPool(gpu0_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dropped_pages, 3u);
  EXPECT_EQ(r->dropped_bytes, 3 * bpp_);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, CacheEvent::Kind::kCleared);
  EXPECT_EQ(events[0].pool, gpu0_);

  // At once: the pool is empty (same capacity and reservation), matches ignore it.
  IndexStats s = index_->Stats();
  ASSERT_EQ(s.pools.size(), 2u);  // the retired pool is not listed
  EXPECT_EQ(Pool(s, gpu0_).used_bytes, 0u);
  EXPECT_EQ(Pool(s, gpu0_).pinned_bytes, 0u);
  EXPECT_EQ(Pool(s, gpu0_).reserved_bytes, bpp_);
  EXPECT_EQ(Pool(s, gpu0_).capacity_bytes, 64ull << 30);
  EXPECT_EQ(Pool(s, gpu1_).pinned_bytes, 2 * bpp_);  // the shared pin stays
  EXPECT_EQ(s.counters.dropped_pages, 3u);
  EXPECT_EQ(MustMatch(Prompt({4}), {.probe = true}).matched_pages, 0u);
  MatchResult m = MustMatch(Prompt({1, 2, 3}), {.probe = true});
  EXPECT_EQ(m.matched_pages, 3u);
  for (const MatchedSegment& seg : m.segments) {
    ASSERT_EQ(seg.num_replicas, 1u);
    EXPECT_EQ(*m.Replicas(seg)[0].pool, gpu1_);
  }
  // The pool takes new pages right away, next to the retired ones.
  MustInsert(Prompt({1}), gpu0_, 50);
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).used_bytes, bpp_);
  m = MustMatch(Prompt({1}), {.probe = true});
  ASSERT_EQ(m.segments.size(), 1u);
  EXPECT_EQ(ReplicasOf(m, m.segments[0]).size(), 2u);  // gpu1 and the new gpu0 replica

  // The sweep removes only unpinned retired replicas: here, none yet.
  SweepResult swept = index_->SweepRetired(100);
  EXPECT_EQ(swept.removed_replicas, 0u);
  EXPECT_EQ(swept.remaining_pages, 3u);
  ASSERT_TRUE(index_->Release(ns_, only.pin_id).ok());  // pins keep working
  swept = index_->SweepRetired(100);
  EXPECT_EQ(swept.removed_replicas, 1u);  // [4], and its node with it
  EXPECT_EQ(swept.remaining_pages, 2u);
  EXPECT_EQ(index_->Stats().namespaces[0].pages, 3u);
  ASSERT_TRUE(index_->Release(ns_, shared.pin_id).ok());
  swept = index_->SweepRetired(100);
  EXPECT_EQ(swept.removed_replicas, 2u);  // [2] then [1] (split by the new insert)
  EXPECT_EQ(swept.remaining_pages, 0u);
  s = index_->Stats();
  EXPECT_EQ(s.namespaces[0].pages, 3u);
  EXPECT_EQ(s.namespaces[0].page_locations, 4u);  // gpu1 x3 and the new gpu0 page
  EXPECT_EQ(index_->SweepRetired(100).removed_replicas, 0u);

  EXPECT_EQ(index_->DropPool({"nobody", Tier::kGpu}).status().code(), absl::StatusCode::kNotFound);
}

// A pool whose agent left for good: no fresh incarnation, it leaves Stats, its reservations
// are released, its pages go as with DropPool, and only a new Insert makes it again.
TEST_F(CacheIndexTest, DropPoolForgettingThePoolTakesItOutOfStats) {
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({1}), gpu1_);
  ASSERT_TRUE(index_->Reserve(gpu0_, bpp_, ns_.tenant).ok());
  ASSERT_EQ(index_->Stats().tenants[0].reserved_bytes, bpp_);

  absl::StatusOr<DropPoolResult> r = index_->DropPool(gpu0_, /*forget=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dropped_pages, 2u);
  IndexStats s = index_->Stats();
  ASSERT_EQ(s.pools.size(), 1u);
  EXPECT_EQ(s.pools[0].pool, gpu1_);
  EXPECT_EQ(s.tenants[0].reserved_bytes, 0u) << "nobody takes the reservation over";
  EXPECT_FALSE(index_->HasPool(gpu0_));
  EXPECT_EQ(index_->PoolGeneration(gpu0_).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MustMatch(Prompt({1, 2}), {.probe = true}).matched_pages, 1u);  // gpu1's page
  while (index_->SweepRetired(100).removed_replicas > 0) {
  }
  EXPECT_EQ(index_->Stats().namespaces[0].page_locations, 1u);
  EXPECT_TRUE(index_->CheckTenantAccounting().ok());
  EXPECT_EQ(index_->DropPool(gpu0_, true).status().code(), absl::StatusCode::kNotFound);

  MustInsert(Prompt({7}), gpu0_);  // an index-only pool may be made again
  EXPECT_EQ(Pool(index_->Stats(), gpu0_).used_bytes, bpp_);
}

TEST_F(CacheIndexTest, RenewingAPinWhosePagesDiedWithTheirAgentIsAborted) {
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({1}), gpu1_);
  MatchResult pin = MustMatch(Prompt({1, 2}), {.pin = true});
  ASSERT_TRUE(index_->RenewLease(ns_, pin.pin_id, absl::ZeroDuration()).ok());
  const uint64_t generation = *index_->PoolGeneration(gpu0_);
  ASSERT_TRUE(index_->DropPool(gpu0_).ok());  // page 2 now has no live replica
  EXPECT_NE(*index_->PoolGeneration(gpu0_), generation);
  absl::StatusOr<absl::Time> renewed = index_->RenewLease(ns_, pin.pin_id, absl::ZeroDuration());
  EXPECT_EQ(renewed.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(renewed.status().message(), HasSubstr("match again"));
  // Release still works, and a pin on pages another pool holds renews.
  ASSERT_TRUE(index_->Release(ns_, pin.pin_id).ok());
  MatchResult alive = MustMatch(Prompt({1}), {.pin = true});
  EXPECT_TRUE(index_->RenewLease(ns_, alive.pin_id, absl::ZeroDuration()).ok());
}

TEST_F(CacheIndexTest, AnInsertBegunBeforeADropDoesNotLandInTheNewPool) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 10 * bpp_).ok());
  const uint64_t generation = *index_->PoolGeneration(gpu0_);
  ASSERT_TRUE(index_->DropPool(gpu0_).ok());  // empty, and still a new generation
  absl::StatusOr<InsertResult> r = index_->Insert(ns_, Prompt({1}), gpu0_, std::vector<BlockId>{3},
                                                  {.pool_generation = generation});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(MustMatch(Prompt({1}), {.probe = true}).matched_pages, 0u);
}

TEST_F(CacheIndexTest, EvictFromNamespaceSeesOnlyLivePagesWhileASweepIsPending) {
  MustInsert(Prompt({1, 2}), gpu0_);
  MustInsert(Prompt({3}), gpu1_);
  ASSERT_TRUE(index_->DropPool(gpu0_).ok());  // retired, not swept
  EXPECT_EQ(index_->EvictFromNamespace(ns_, bpp_ + 1).status().code(),
            absl::StatusCode::kOutOfRange);
  MatchResult pin = MustMatch(Prompt({3}), {.pin = true});
  EXPECT_EQ(index_->EvictFromNamespace(ns_, bpp_).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(index_->Release(ns_, pin.pin_id).ok());
  absl::StatusOr<EvictResult> r = index_->EvictFromNamespace(ns_, bpp_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->evicted_pages, 1u);
  EXPECT_EQ(Pool(index_->Stats(), gpu1_).used_bytes, 0u);
}

TEST_F(CacheIndexTest, SweepRemovesInSmallSteps) {
  for (int i = 0; i < 10; ++i) MustInsert(Prompt({i, 100 + i}), gpu0_);  // 10 two-node paths
  ASSERT_TRUE(index_->DropPool(gpu0_).ok());
  uint64_t steps = 0;
  for (SweepResult r; (r = index_->SweepRetired(3)).removed_replicas > 0;) {
    EXPECT_LE(r.removed_replicas, 3u);
    ++steps;
  }
  EXPECT_GE(steps, 4u);
  EXPECT_EQ(index_->Stats().namespaces[0].radix_nodes, 0u);
}

// An oracle that knows nothing: every page is needed again "soon", by hash order. Enough
// for "opt" to run in tests that are not about its choices.
class HashOrderOracle final : public NextUseOracle {
 public:
  uint64_t NextUse(const PageHash& page) const override { return page.lo >> 1; }
};

// Every block id a match returns is the one its pool was given for that page, whatever the
// tree's shape (splits, the shortcut by the last page, several pools per node), the
// requester and the mode; segments tile the match and list the requester's pools first.
TEST_F(CacheIndexTest, RandomMatchesReturnTheBlocksEachPoolHolds) {
  std::mt19937 rng(13);
  const PoolKey pools[] = {gpu0_, gpu1_, {"gpu-2", Tier::kGpu}, {"gpu-0", Tier::kHost}};
  const std::string agents[] = {"", "gpu-0", "gpu-1", "gpu-2"};
  constexpr size_t kPools = std::size(pools);
  for (const PoolKey& p : pools) ASSERT_TRUE(index_->SetPoolCapacity(p, 100'000 * bpp_).ok());
  std::map<std::pair<size_t, PageHash>, BlockId> held;  // (pool, page) -> its block
  BlockId next_block[kPools] = {};
  int multi_replica_segments = 0;
  for (int step = 0; step < 3000; ++step) {
    std::vector<int32_t> ids;
    for (int n = 1 + rng() % 10; n > 0; --n) ids.push_back(rng() % 3);
    const std::vector<PageHash> pages = Prompt(ids);
    if (rng() % 5 < 2) {
      const size_t p = rng() % kPools;
      const std::vector<BlockId> blocks = Blocks(next_block[p], pages.size());
      next_block[p] += pages.size();
      MustInsert(pages, pools[p], blocks[0]);
      // Pages the pool held already keep their blocks.
      for (size_t i = 0; i < pages.size(); ++i) held.try_emplace({p, pages[i]}, blocks[i]);
      continue;
    }
    const std::string& requester = agents[rng() % std::size(agents)];
    const MatchResult m =
        MustMatch(pages, {.requester_agent_id = requester, .probe = rng() % 2 == 0});
    // Pools are prefix-closed: the match is the longest prefix one pool holds.
    uint32_t want = 0;
    for (size_t p = 0; p < kPools; ++p) {
      uint32_t n = 0;
      while (n < pages.size() && held.contains({p, pages[n]})) ++n;
      want = std::max(want, n);
    }
    ASSERT_EQ(m.matched_pages, want) << "step " << step;
    uint32_t next_page = 0;
    for (const MatchedSegment& seg : m.segments) {
      ASSERT_EQ(seg.first_page, next_page) << "step " << step;
      ASSERT_GT(seg.num_pages, 0u);
      next_page += seg.num_pages;
      ASSERT_LE(seg.first_replica + seg.num_replicas, m.replicas.size());
      multi_replica_segments += seg.num_replicas > 1;
      std::vector<size_t> listed;
      bool others_began = false;
      for (const MatchedReplica& r : m.Replicas(seg)) {
        const size_t p = std::find(pools, pools + kPools, *r.pool) - pools;
        ASSERT_LT(p, kPools);
        listed.push_back(p);
        const bool own = !requester.empty() && r.pool->agent_id == requester;
        EXPECT_FALSE(own && others_began) << "step " << step << ": requester's pool listed late";
        others_began |= !own;
        ASSERT_LE(r.first_block + seg.num_pages, m.block_ids.size());
        const std::span<const BlockId> got = m.BlockIds(seg, r);
        for (uint32_t i = 0; i < seg.num_pages; ++i) {
          const auto it = held.find({p, pages[seg.first_page + i]});
          ASSERT_NE(it, held.end()) << "step " << step << ": pool " << p << " lacks the page";
          EXPECT_EQ(got[i], it->second) << "step " << step << ", page " << seg.first_page + i;
        }
      }
      // Exactly the pools that hold the segment (its last page, as pools are prefix-closed).
      std::vector<size_t> holders;
      for (size_t p = 0; p < kPools; ++p) {
        if (held.contains({p, pages[seg.first_page + seg.num_pages - 1]})) holders.push_back(p);
      }
      std::sort(listed.begin(), listed.end());
      EXPECT_EQ(listed, holders) << "step " << step;
    }
    ASSERT_EQ(next_page, m.matched_pages) << "step " << step;
  }
  EXPECT_GT(multi_replica_segments, 200) << "too few segments held by several pools";
}

TEST_F(CacheIndexTest, RandomOperationsKeepAccountingConsistent) {
  static const HashOrderOracle oracle;
  for (const char* policy :
       {"lru", "lru-mha", "cost", "adaptive", "density", "conversation", "opt"}) {
    SCOPED_TRACE(policy);
    Reset(CacheIndexOptions{.policy = policy, .next_use = &oracle});
    RunRandomOperations();
  }
}

void CacheIndexTest::RunRandomOperations() {
  std::mt19937 rng(7);
  const PoolKey pools[] = {gpu0_, gpu1_, {"gpu-0", Tier::kHost}};
  for (const PoolKey& p : pools) ASSERT_TRUE(index_->SetPoolCapacity(p, 40 * bpp_).ok());
  std::vector<PinId> pins;
  for (int step = 0; step < 3000; ++step) {
    std::vector<int32_t> ids;
    const int len = 1 + rng() % 8;
    for (int i = 0; i < len; ++i) ids.push_back(rng() % 3);  // heavy prefix sharing
    std::vector<PageHash> pages = Prompt(ids);
    const PoolKey& pool = pools[rng() % 3];
    const uint32_t op = rng() % 41;  // 0..39: the five common operations; 40: drop a pool
    switch (op == 40 ? 5 : op % 5) {
      case 0:
      case 1: {
        auto r = index_->Insert(ns_, pages, pool, Blocks(rng() % 1000, pages.size()));
        ASSERT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kResourceExhausted)
            << r.status();
        break;
      }
      case 2: {
        auto m = index_->Match(ns_, pages, {.pin = rng() % 2 == 0});
        ASSERT_TRUE(m.ok());
        if (m->pin_id != 0) pins.push_back(m->pin_id);
        break;
      }
      case 3:
        if (!pins.empty()) {
          ASSERT_TRUE(index_->Release(ns_, pins.back()).ok());
          pins.pop_back();
        }
        break;
      case 4: {
        const PoolStats p = Pool(index_->Stats(), pool);
        if (p.used_bytes > p.pinned_bytes) {
          ASSERT_TRUE(
              index_->EvictFromPool(pool, 1 + rng() % (p.used_bytes - p.pinned_bytes)).ok());
        }
        break;
      }
      case 5: {
        ASSERT_TRUE(index_->DropPool(pool).ok());
        ASSERT_EQ(Pool(index_->Stats(), pool).used_bytes, 0u);
        // Pinned retired pages stay until their pins go; sweep what can go now.
        while (index_->SweepRetired(rng() % 8 + 1).removed_replicas > 0) {
        }
        break;
      }
    }
    IndexStats s = index_->Stats();
    uint64_t pages_in_pools = 0;
    for (const PoolStats& p : s.pools) {
      ASSERT_EQ(p.used_bytes, p.pages * bpp_);
      ASSERT_LE(p.pinned_bytes, p.used_bytes);
      ASSERT_LE(p.used_bytes, p.capacity_bytes);
      pages_in_pools += p.pages;
    }
    // Retired pages not swept yet (pinned) still sit in the tree.
    pages_in_pools += index_->SweepRetired(0).remaining_pages;
    ASSERT_EQ(pages_in_pools, s.namespaces[0].page_locations);
    ASSERT_EQ(s.active_pins, pins.size());
    absl::Status tenants = index_->CheckTenantAccounting();
    ASSERT_TRUE(tenants.ok()) << tenants;
  }
  for (PinId id : pins) ASSERT_TRUE(index_->Release(ns_, id).ok());
  while (index_->SweepRetired(16).removed_replicas > 0) {
  }
  EXPECT_EQ(index_->SweepRetired(0).remaining_pages, 0u);
  for (const PoolKey& p : pools) {
    const uint64_t used = Pool(index_->Stats(), p).used_bytes;
    if (used > 0) {
      ASSERT_TRUE(index_->EvictFromPool(p, used).ok());
    }
  }
  IndexStats s = index_->Stats();
  EXPECT_EQ(s.namespaces[0].pages, 0u);
  EXPECT_EQ(s.namespaces[0].radix_nodes, 0u);
}

}  // namespace
}  // namespace kvcm
