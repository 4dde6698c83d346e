#include "server/core/inventory_restore.h"

#include <memory>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

const NamespaceId kNs{"acme", "dsv3"};
const PoolKey kPool{"gpu-0", Tier::kGpu};

ModelSpec Mla() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = 4};
}

PageHash P(uint64_t n) { return PageHash{.lo = n, .hi = ~n}; }

// The inventory entries of a prompt path: pages[i] in blocks[i], chained.
std::vector<InventoryPage> Path(std::vector<uint64_t> pages, std::vector<BlockId> blocks) {
  std::vector<InventoryPage> out;
  PageHash parent;
  for (size_t i = 0; i < pages.size(); ++i) {
    out.push_back({.block = blocks[i], .page = P(pages[i]), .parent = parent});
    parent = P(pages[i]);
  }
  return out;
}

std::vector<PageHash> Pages(std::vector<uint64_t> ids) {
  std::vector<PageHash> out;
  for (uint64_t id : ids) out.push_back(P(id));
  return out;
}

class InventoryRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = std::make_unique<CacheIndex>(
        CacheIndexOptions{.hash_secret = HashKey{1, 2}, .default_pool_capacity_bytes = 0});
    ASSERT_TRUE(index_->SetPoolCapacity(kPool, 100 * Mla().BytesPerPage()).ok());
  }

  absl::StatusOr<RestoreResult> Restore(std::vector<InventoryPage> pages, ModelSpec spec = Mla()) {
    return RestoreInventory(*index_, kPool, Mla().BytesPerPage(),
                            InventoryBatch{.ns = kNs, .spec = spec, .pages = std::move(pages)});
  }

  // Block ids the index holds in kPool for `pages` (a prompt's leading pages).
  std::vector<BlockId> Blocks(std::vector<uint64_t> pages) {
    absl::StatusOr<MatchResult> m = index_->Match(kNs, Pages(pages), {.probe = true});
    std::vector<BlockId> out;
    if (!m.ok()) return out;
    for (const MatchedSegment& seg : m->segments) {
      for (const MatchedReplica& r : m->Replicas(seg)) {
        if (*r.pool != kPool) continue;
        const std::span<const BlockId> ids = m->BlockIds(seg, r);
        out.insert(out.end(), ids.begin(), ids.end());
      }
    }
    return out;
  }

  uint64_t IndexedPages() {
    uint64_t n = 0;
    for (const PoolStats& p : index_->Stats().pools) n += p.pages;
    return n;
  }

  std::unique_ptr<CacheIndex> index_;
};

TEST_F(InventoryRestoreTest, RebuildsBranchingPromptsWithTheSameBlocksAndTheNamespace) {
  // Two prompts sharing pages 1, 2, then branching; the inventory is in no particular order.
  std::vector<InventoryPage> inv = Path({1, 2, 3, 4}, {10, 11, 12, 13});
  std::vector<InventoryPage> other = Path({1, 2, 5}, {10, 11, 14});
  inv.insert(inv.begin(), other.back());
  std::reverse(inv.begin(), inv.end());
  absl::StatusOr<RestoreResult> r = Restore(inv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->indexed_pages, 5u);
  EXPECT_TRUE(r->to_free.empty());
  EXPECT_THAT(Blocks({1, 2, 3, 4}), ElementsAre(10, 11, 12, 13));
  EXPECT_THAT(Blocks({1, 2, 5}), ElementsAre(10, 11, 14));
  // The namespace came back with its spec.
  absl::StatusOr<RegisterModelResult> ns = index_->GetNamespace(kNs);
  ASSERT_TRUE(ns.ok());
  EXPECT_EQ(ns->spec, Mla());
}

TEST_F(InventoryRestoreTest, PagesWhoseChainIsIncompleteAreFreedNotIndexed) {
  // Page 7's parent (6) is in no inventory: 7 and its child 8 are orphans.
  std::vector<InventoryPage> inv = Path({1, 2}, {20, 21});
  inv.push_back({.block = 22, .page = P(7), .parent = P(6)});
  inv.push_back({.block = 23, .page = P(8), .parent = P(7)});
  // A cycle, which hashes cannot form but a corrupt inventory could.
  inv.push_back({.block = 24, .page = P(30), .parent = P(31)});
  inv.push_back({.block = 25, .page = P(31), .parent = P(30)});
  absl::StatusOr<RestoreResult> r = Restore(inv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->indexed_pages, 2u);
  EXPECT_EQ(r->orphan_pages, 4u);
  EXPECT_THAT(r->to_free, UnorderedElementsAre(22, 23, 24, 25));
  EXPECT_EQ(IndexedPages(), 2u);
}

TEST_F(InventoryRestoreTest, SecondBlockOfAPageIsADuplicateToFree) {
  std::vector<InventoryPage> inv = Path({1, 2}, {30, 31});
  inv.push_back({.block = 32, .page = P(2), .parent = P(1)});
  absl::StatusOr<RestoreResult> r = Restore(inv);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->duplicate_pages, 1u);
  EXPECT_THAT(r->to_free, ElementsAre(32));
  EXPECT_THAT(Blocks({1, 2}), ElementsAre(30, 31));
  // The pool already holding a page in another block: the inventory's block is spare.
  absl::StatusOr<RestoreResult> again = Restore(Path({1, 2, 3}, {40, 41, 42}));
  ASSERT_TRUE(again.ok());
  EXPECT_THAT(again->to_free, UnorderedElementsAre(40, 41));
  EXPECT_THAT(Blocks({1, 2, 3}), ElementsAre(30, 31, 42));
}

TEST_F(InventoryRestoreTest, ANamespaceThatCannotLiveInThePoolIsFreedWhole) {
  ASSERT_TRUE(index_->RegisterModel(kNs, Mla()).ok());
  ModelSpec other = Mla();
  other.dtype = KvDtype::kFp8;  // another spec for a registered namespace
  absl::StatusOr<RestoreResult> conflict = Restore(Path({1, 2}, {1, 2}), other);
  ASSERT_TRUE(conflict.ok());
  EXPECT_EQ(conflict->refused_pages, 2u);
  EXPECT_THAT(conflict->to_free, UnorderedElementsAre(1, 2));
  // A page size in bytes other than the pool's blocks.
  ModelSpec bigger = Mla();
  bigger.page_size_tokens = 8;
  absl::StatusOr<RestoreResult> size = RestoreInventory(
      *index_, kPool, Mla().BytesPerPage(),
      InventoryBatch{.ns = {"acme", "big"}, .spec = bigger, .pages = Path({1}, {3})});
  ASSERT_TRUE(size.ok());
  EXPECT_THAT(size->to_free, ElementsAre(3));
  EXPECT_EQ(IndexedPages(), 0u);
  EXPECT_FALSE(index_->GetNamespace({"acme", "big"}).ok());
}

// A restarted manager learns a namespace's kv_layout from the agents that hold its pages
// (whoever holds the KV is the truth) and goes on refusing another layout.
TEST_F(InventoryRestoreTest, ARestoredNamespaceKeepsItsLayoutAndRefusesAnother) {
  ModelSpec cpu = Mla();
  cpu.kv_layout = "vllm-cpu/mla:[block,576]:bf16";
  ModelSpec flash = Mla();
  flash.kv_layout = "flash-mla:[block,576]:bf16";
  absl::StatusOr<RestoreResult> r = Restore(Path({1, 2}, {1, 2}), cpu);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->indexed_pages, 2u);
  EXPECT_EQ(index_->GetNamespace(kNs)->spec, cpu);

  absl::StatusOr<RegisterModelResult> client = index_->RegisterModel(kNs, flash);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(client.status().message(), HasSubstr(flash.kv_layout));
  EXPECT_THAT(client.status().message(), HasSubstr(cpu.kv_layout));
  EXPECT_EQ(index_->RegisterModel(kNs, Mla())->spec, cpu) << "an unstated layout is compatible";

  // Another agent's pages in another layout are freed; its pages without one are indexed.
  const PoolKey other{"gpu-1", Tier::kGpu};
  ASSERT_TRUE(index_->SetPoolCapacity(other, 100 * Mla().BytesPerPage()).ok());
  absl::StatusOr<RestoreResult> refused =
      RestoreInventory(*index_, other, Mla().BytesPerPage(),
                       InventoryBatch{.ns = kNs, .spec = flash, .pages = Path({1, 3}, {7, 8})});
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->refused_pages, 2u);
  EXPECT_THAT(refused->to_free, UnorderedElementsAre(7, 8));
  absl::StatusOr<RestoreResult> unstated =
      RestoreInventory(*index_, other, Mla().BytesPerPage(),
                       InventoryBatch{.ns = kNs, .spec = Mla(), .pages = Path({1, 3}, {7, 8})});
  ASSERT_TRUE(unstated.ok()) << unstated.status();
  EXPECT_EQ(unstated->indexed_pages, 2u);
  EXPECT_EQ(index_->GetNamespace(kNs)->spec, cpu);
}

// A client that states no layout may register before the agents are back; their
// inventories then give the namespace the layout its pages were written in.
TEST_F(InventoryRestoreTest, AnInventoryGivesItsLayoutToANamespaceRegisteredWithout) {
  ASSERT_TRUE(index_->RegisterModel(kNs, Mla()).ok());
  ModelSpec cpu = Mla();
  cpu.kv_layout = "vllm-cpu/mla:[block,576]:bf16";
  absl::StatusOr<RestoreResult> r = Restore(Path({1}, {1}), cpu);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->indexed_pages, 1u);
  EXPECT_EQ(index_->GetNamespace(kNs)->spec, cpu);
}

TEST_F(InventoryRestoreTest, MalformedBatchIsRefusedAndChangesNothing) {
  struct Case {
    const char* name;
    std::vector<InventoryPage> pages;
    const char* message;
  };
  std::vector<InventoryPage> twice = Path({1, 2}, {5, 5});
  std::vector<InventoryPage> pending = Path({1}, {kPendingBlock});
  const Case cases[] = {{"block twice", twice, "pages[1].block_id: block 5 is listed twice"},
                        {"pending", pending, "pages[0].block_id: 4294967295 is reserved"}};
  for (const Case& c : cases) {
    absl::StatusOr<RestoreResult> r = Restore(c.pages);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.name;
  }
  ModelSpec bad = Mla();
  bad.num_layers = 0;
  EXPECT_EQ(Restore(Path({1}, {1}), bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IndexedPages(), 0u);
  EXPECT_FALSE(index_->GetNamespace(kNs).ok()) << "a refused batch registers nothing";
  EXPECT_EQ(RestoreInventory(*index_, PoolKey{"nobody", Tier::kGpu}, Mla().BytesPerPage(),
                             InventoryBatch{.ns = kNs, .spec = Mla(), .pages = Path({1}, {1})})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST_F(InventoryRestoreTest, PagesThePoolHasNoRoomForAreFreed) {
  ASSERT_TRUE(index_->SetPoolCapacity(kPool, 2 * Mla().BytesPerPage()).ok());
  absl::StatusOr<RestoreResult> r = Restore(Path({1, 2, 3}, {1, 2, 3}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->indexed_pages, 0u);
  EXPECT_EQ(r->refused_pages, 3u);
  EXPECT_THAT(r->to_free, UnorderedElementsAre(1, 2, 3));
}

TEST_F(InventoryRestoreTest, CollectorGathersChunksThenRestoresEveryPool) {
  const PoolKey host{"gpu-0", Tier::kHost};
  ASSERT_TRUE(index_->SetPoolCapacity(host, 100 * Mla().BytesPerPage()).ok());
  InventoryCollector collector(
      "gpu-0", Mla().BytesPerPage(),
      {{.tier = Tier::kGpu, .num_blocks = 50, .generation = *index_->PoolGeneration(kPool)},
       {.tier = Tier::kHost, .num_blocks = 50, .generation = *index_->PoolGeneration(host)}});
  // A prompt split over two chunks (the child first), and its copy in the HOST pool.
  std::vector<InventoryPage> path = Path({1, 2, 3}, {4, 5, 6});
  ASSERT_TRUE(collector.Add(Tier::kGpu, kNs, Mla(), {path[2]}).ok());
  EXPECT_EQ(IndexedPages(), 0u) << "nothing is restored before the stream ends";
  ASSERT_TRUE(collector.Add(Tier::kGpu, kNs, Mla(), {path[0], path[1]}).ok());
  ASSERT_TRUE(collector.Add(Tier::kHost, kNs, Mla(), Path({1}, {4})).ok());
  ASSERT_TRUE(
      collector.Add(Tier::kHost, kNs, Mla(), {{.block = 9, .page = P(8), .parent = P(7)}}).ok());

  absl::StatusOr<InventoryOutcome> out = collector.Restore(*index_);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->indexed_pages, 4u);
  EXPECT_EQ(out->orphan_pages, 1u);
  EXPECT_THAT(out->to_free[Tier::kHost], ElementsAre(9));
  EXPECT_TRUE(out->to_free[Tier::kGpu].empty());
  EXPECT_THAT(Blocks({1, 2, 3}), ElementsAre(4, 5, 6));
}

TEST_F(InventoryRestoreTest, CollectorRefusesWhatNoAgentCanHoldAndAddsNothing) {
  InventoryCollector collector(
      "gpu-0", Mla().BytesPerPage(),
      {{.tier = Tier::kGpu, .num_blocks = 10, .generation = *index_->PoolGeneration(kPool)}});
  ASSERT_TRUE(collector.Add(Tier::kGpu, kNs, Mla(), Path({1}, {3})).ok());
  struct Case {
    const char* name;
    Tier tier;
    ModelSpec spec;
    std::vector<InventoryPage> pages;
    const char* message;
  };
  ModelSpec fp8 = Mla();
  fp8.dtype = KvDtype::kFp8;
  const Case cases[] = {
      {"not a pool of the agent", Tier::kHost, Mla(), Path({2}, {4}), "tier host"},
      {"two specs", Tier::kGpu, fp8, Path({2}, {4}), "spec: namespace acme/dsv3"},
      {"past the pool", Tier::kGpu, Mla(), Path({2, 5}, {4, 10}), "block_ids[1]: block 10"},
      {"pending", Tier::kGpu, Mla(), Path({2}, {kPendingBlock}), "reserved"},
      {"twice in one chunk", Tier::kGpu, Mla(), Path({2, 5}, {4, 4}), "listed twice"},
      {"twice across chunks", Tier::kGpu, Mla(), Path({2}, {3}), "block_ids[0]: block 3"},
  };
  for (const Case& c : cases) {
    absl::Status s = collector.Add(c.tier, kNs, c.spec, c.pages);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name;
  }
  EXPECT_EQ(collector.pages(), 1u);
  // Block 4 was refused above, so it is still free to list.
  ASSERT_TRUE(collector.Add(Tier::kGpu, kNs, Mla(), Path({2}, {4})).ok());

  // The pool was dropped (its agent re-registered) before the restore: nothing lands.
  ASSERT_TRUE(index_->DropPool(kPool).ok());
  EXPECT_EQ(collector.Restore(*index_).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(IndexedPages(), 0u);
}

// Retention: rebuilt pages keep the commit times the agent recorded.
class InventoryRestoreAgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = std::make_unique<CacheIndex>(CacheIndexOptions{
        .hash_secret = HashKey{1, 2}, .default_pool_capacity_bytes = 0, .clock = &clock_});
    ASSERT_TRUE(index_->SetPoolCapacity(kPool, 100 * Mla().BytesPerPage()).ok());
  }

  // `pages` chained in `blocks`, committed `ages` ago (one per page).
  std::vector<InventoryPage> Aged(std::vector<uint64_t> pages, std::vector<BlockId> blocks,
                                  std::vector<absl::Duration> ages) {
    std::vector<InventoryPage> out = Path(std::move(pages), std::move(blocks));
    for (size_t i = 0; i < out.size(); ++i) {
      out[i].committed_unix_ms = absl::ToUnixMillis(clock_.Now() - ages[i]);
    }
    return out;
  }

  absl::StatusOr<RestoreResult> Restore(std::vector<InventoryPage> pages,
                                        absl::Duration max_age = absl::Hours(1)) {
    return RestoreInventory(
        *index_, kPool, Mla().BytesPerPage(),
        InventoryBatch{.ns = kNs, .spec = Mla(), .max_page_age = max_age, .pages = pages});
  }

  uint32_t Matched(std::vector<uint64_t> pages) {
    absl::StatusOr<MatchResult> m = index_->Match(kNs, Pages(pages), {.probe = true});
    return m.ok() ? m->matched_pages : 0;
  }

  uint64_t Sweep() {
    uint64_t n = 0;
    for (ExpirySweepResult r; (r = index_->SweepExpired(64)).expired_pages > 0 || r.more;) {
      n += r.expired_pages;
    }
    return n;
  }

  FakeClock clock_;
  std::unique_ptr<CacheIndex> index_;
};

TEST_F(InventoryRestoreAgeTest, APageKeepsItsAgeAndTheNamespaceItsLimit) {
  const absl::Duration m50 = absl::Minutes(50);
  absl::StatusOr<RestoreResult> r = Restore(Aged({1, 2, 3}, {7, 8, 9}, {m50, m50, m50}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->indexed_pages, 3u);
  EXPECT_EQ(index_->GetNamespace(kNs)->max_page_age, absl::Hours(1));  // from the inventory
  EXPECT_EQ(Matched({1, 2, 3}), 3u);
  clock_.Advance(absl::Minutes(10) - absl::Milliseconds(1));
  EXPECT_EQ(Sweep(), 0u);
  clock_.Advance(absl::Milliseconds(1));  // 60 minutes old
  EXPECT_EQ(Matched({1, 2, 3}), 0u);
  EXPECT_EQ(Sweep(), 3u);
}

TEST_F(InventoryRestoreAgeTest, PagesPastTheirAgeAreNotRebuiltAndTheirBlocksFreed) {
  const absl::Duration old = absl::Hours(2), young = absl::Minutes(10);
  std::vector<InventoryPage> pages = Aged({1, 2, 3}, {1, 2, 3}, {old, old, young});
  // A young prompt beside it stays.
  for (const InventoryPage& p : Aged({5, 6}, {5, 6}, {young, young})) pages.push_back(p);
  absl::StatusOr<RestoreResult> r = Restore(pages);
  ASSERT_TRUE(r.ok()) << r.status();
  // Page 3 is young but below expired pages: the pool holds whole prefixes.
  EXPECT_EQ(r->expired_pages, 3u);
  EXPECT_EQ(r->indexed_pages, 2u);
  EXPECT_THAT(r->to_free, UnorderedElementsAre(1, 2, 3));
  EXPECT_EQ(Matched({1, 2, 3}), 0u);
  EXPECT_EQ(Matched({5, 6}), 2u);
}

TEST_F(InventoryRestoreAgeTest, EachPageKeepsItsOwnCommitTime) {
  // Page 3 was committed before its parents (it can be: the parents' first blocks were
  // freed and their pages committed again); it expires first, alone.
  const absl::Duration m5 = absl::Minutes(5), m50 = absl::Minutes(50);
  ASSERT_TRUE(Restore(Aged({1, 2, 3}, {1, 2, 3}, {m5, m5, m50})).ok());
  EXPECT_EQ(Matched({1, 2, 3}), 3u);
  clock_.Advance(absl::Minutes(10));
  EXPECT_EQ(Matched({1, 2, 3}), 2u);
  EXPECT_EQ(Sweep(), 1u);
  EXPECT_EQ(Matched({1, 2}), 2u);
}

TEST_F(InventoryRestoreAgeTest, NoTimeOrAFutureOneCountsFromTheRebuild) {
  std::vector<InventoryPage> pages = Path({1}, {1});  // committed_unix_ms 0: not recorded
  pages.push_back(Aged({9}, {9}, {-absl::Hours(3)})[0]);
  ASSERT_TRUE(Restore(pages).ok());
  clock_.Advance(absl::Minutes(59));
  EXPECT_EQ(Sweep(), 0u);
  clock_.Advance(absl::Minutes(1));
  EXPECT_EQ(Sweep(), 2u);
}

TEST_F(InventoryRestoreAgeTest, BadTimesAndAgesAreInvalidArgumentAndAddNothing) {
  std::vector<InventoryPage> pages = Path({1}, {1});
  pages[0].committed_unix_ms = -5;
  absl::StatusOr<RestoreResult> r = Restore(pages);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("committed_unix_ms"));
  r = Restore(Path({1}, {1}), absl::Seconds(int64_t{kMaxPageAgeS} + 1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("max_page_age_s"));
  EXPECT_EQ(index_->GetNamespace(kNs).status().code(), absl::StatusCode::kNotFound);

  InventoryCollector collector(
      "gpu-0", Mla().BytesPerPage(),
      {{.tier = Tier::kGpu, .num_blocks = 10, .generation = *index_->PoolGeneration(kPool)}});
  std::vector<InventoryPage> bad = Path({1, 2}, {1, 2});
  bad[1].committed_unix_ms = -1;
  absl::Status s = collector.Add(Tier::kGpu, kNs, Mla(), bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("committed_unix_ms[1]"));
  s = collector.Add(Tier::kGpu, kNs, Mla(), Path({1}, {1}),
                    absl::Seconds(int64_t{kMaxPageAgeS} + 1));
  EXPECT_THAT(s.message(), HasSubstr("max_page_age_s"));
  EXPECT_EQ(collector.pages(), 0u);
  // Nothing of the refused chunks stuck: the same blocks may be listed now; two chunks'
  // limits keep the shorter.
  ASSERT_TRUE(collector.Add(Tier::kGpu, kNs, Mla(), Path({1}, {1}), absl::Seconds(900)).ok());
  ASSERT_TRUE(collector.Add(Tier::kGpu, kNs, Mla(), Path({2}, {2}), absl::Seconds(600)).ok());
  ASSERT_TRUE(collector.Add(Tier::kGpu, kNs, Mla(), Path({3}, {3})).ok());
  ASSERT_TRUE(collector.Restore(*index_).ok());
  EXPECT_EQ(index_->GetNamespace(kNs)->max_page_age, absl::Seconds(600));
}

}  // namespace
}  // namespace kvcm
