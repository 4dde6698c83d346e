// CacheIndex's reader/writer split: matches that do not pin share the lock and record their
// recency updates, which the next exclusive call applies (cache_index.h).
#include <algorithm>
#include <atomic>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "server/core/cache_index.h"
#include "server/core/policies/registry.h"
#include "server/core/router.h"

namespace kvcm {
namespace {

constexpr uint32_t kPage = 4;  // tokens per page

ModelSpec Mla() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = kPage};
}

const NamespaceId kNs{"acme", "deepseek-v3"};

// Prompt p of a small family: one of 4 system prompts (3 pages), one of 6 middles (2 pages),
// then 0-4 pages of its own, so prompts share prefixes and end inside each other's nodes.
std::vector<int32_t> PromptTokens(uint32_t p) {
  std::vector<int32_t> pages = {int32_t(p % 4), 10, 11};
  pages.push_back(int32_t(100 + p % 24));
  pages.push_back(101);
  for (uint32_t i = 0; i < p % 5; ++i) pages.push_back(int32_t(1000 + p * 10 + i));
  std::vector<int32_t> tokens;
  for (int32_t id : pages) tokens.insert(tokens.end(), kPage, id);
  return tokens;
}

std::vector<BlockId> Blocks(uint32_t first, size_t n) {
  std::vector<BlockId> b(n);
  std::iota(b.begin(), b.end(), first);
  return b;
}

// What leaves the index, in order: (pool, first page, pages, reason).
using Removal = std::tuple<std::string, uint64_t, size_t, int>;

struct Arm {
  explicit Arm(const std::string& policy) {
    CacheIndexOptions options;
    options.policy = policy;
    options.clock = &clock;
    options.hash_secret = HashKey{11, 22};
    index = std::make_unique<CacheIndex>(options);
    EXPECT_TRUE(index->RegisterModel(kNs, Mla()).ok());
    const uint64_t page_bytes =
        policy == "lru-mha" ? Mla().MhaShapedBytesPerToken() * kPage : Mla().BytesPerPage();
    EXPECT_TRUE(index->SetPoolCapacity(gpu, 40 * page_bytes).ok());
    index->SetEventListener([this](const CacheEvent& e) {
      if (e.kind != CacheEvent::Kind::kRemoved) return;
      removals.emplace_back(e.pool.ToString(), e.pages.front().lo, e.pages.size(),
                            static_cast<int>(e.reason));
    });
  }

  FakeClock clock;
  PoolKey gpu{"gpu-0", Tier::kGpu};
  std::unique_ptr<CacheIndex> index;
  std::vector<Removal> removals;
};

class PendingAccessTest : public ::testing::TestWithParam<std::string> {};

// A counting match that shares the lock (arm `deferred`) must leave the eviction order
// exactly as a match that applies its touch at once does (arm `direct`: a pinning match,
// released at once; pinning and unpinning leave the order as it was). Runs of several
// matches between writers hit the same nodes at different depths, so deferred splits
// stack on each other.
TEST_P(PendingAccessTest, AppliedAccessesEvictInTheOrderOfDirectTouches) {
  Arm deferred(GetParam()), direct(GetParam());
  std::mt19937 rng(7);
  uint32_t block = 0;
  for (int step = 0; step < 3'000; ++step) {
    const uint32_t p = rng() % 96;
    const std::vector<int32_t> tokens = PromptTokens(p);
    std::vector<PageHash> pages = *deferred.index->HashTokens(kNs, tokens);
    // Matches ask for a prefix of the prompt too, ending inside nodes.
    const size_t asked = 1 + rng() % pages.size();
    const uint32_t op = rng() % 10;
    if (op < 6) {
      std::span<const PageHash> q(pages.data(), asked);
      absl::StatusOr<MatchResult> a = deferred.index->Match(kNs, q, {});
      absl::StatusOr<MatchResult> b = direct.index->Match(kNs, q, {.pin = true});
      ASSERT_TRUE(a.ok() && b.ok());
      ASSERT_EQ(a->matched_pages, b->matched_pages) << "step " << step;
      if (b->pin_id != 0) {
        ASSERT_TRUE(direct.index->Release(kNs, b->pin_id).ok());
      }
    } else if (op < 9) {
      const std::vector<BlockId> ids = Blocks(block, pages.size());
      block += pages.size();
      absl::StatusOr<InsertResult> a = deferred.index->Insert(kNs, pages, deferred.gpu, ids);
      absl::StatusOr<InsertResult> b = direct.index->Insert(kNs, pages, direct.gpu, ids);
      ASSERT_TRUE(a.ok() && b.ok());
      ASSERT_EQ(a->evicted_bytes, b->evicted_bytes) << "step " << step;
    } else {
      const absl::Duration d = absl::Seconds(1 + rng() % 20);
      deferred.clock.Advance(d);
      direct.clock.Advance(d);
    }
    ASSERT_EQ(deferred.removals.size(), direct.removals.size()) << "step " << step;
  }
  EXPECT_EQ(deferred.removals, direct.removals);
  EXPECT_GT(deferred.removals.size(), 100u);
  // A last writer applies what is pending; then the trees are the same too.
  deferred.index->ExpireLeases();
  const IndexStats a = deferred.index->Stats(), b = direct.index->Stats();
  EXPECT_EQ(a.namespaces[0].radix_nodes, b.namespaces[0].radix_nodes);
  EXPECT_EQ(a.counters.match_requests, b.counters.match_requests);
  EXPECT_EQ(a.counters.matched_pages, b.counters.matched_pages);
  EXPECT_EQ(a.counters.eviction_regret_pages, b.counters.eviction_regret_pages);
  EXPECT_GT(a.counters.eviction_regret_pages, 0u);
  EXPECT_EQ(a.namespaces[0].matched_tokens, b.namespaces[0].matched_tokens);
  EXPECT_TRUE(deferred.index->CheckTenantAccounting().ok());
}

// Every policy the manager serves (select without a requester: it evicts as lru).
std::vector<std::string> ServedPolicies() {
  std::vector<std::string> names;
  for (const PolicyEntry& row : PolicyTable()) {
    if (!row.clairvoyant) names.emplace_back(row.name);
  }
  return names;
}

INSTANTIATE_TEST_SUITE_P(Policies, PendingAccessTest, ::testing::ValuesIn(ServedPolicies()),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Many counting matches with no writer between them: the reader that fills the buffer
// applies it, and nothing is lost.
TEST(CacheIndexConcurrencyTest, AFullBufferIsAppliedByTheReader) {
  Arm arm("lru");
  std::vector<PageHash> a = *arm.index->HashTokens(kNs, PromptTokens(1));
  std::vector<PageHash> b = *arm.index->HashTokens(kNs, PromptTokens(2));
  ASSERT_TRUE(arm.index->Insert(kNs, a, arm.gpu, Blocks(0, a.size())).ok());
  ASSERT_TRUE(arm.index->Insert(kNs, b, arm.gpu, Blocks(100, b.size())).ok());
  // b was inserted last; 1,000 matches of a make it the most recent.
  for (int i = 0; i < 1'000; ++i) ASSERT_TRUE(arm.index->Match(kNs, a, {}).ok());
  EXPECT_EQ(arm.index->Stats().counters.match_requests, 1'000u);
  ASSERT_TRUE(arm.index->EvictFromPool(arm.gpu, 1).ok());
  ASSERT_EQ(arm.removals.size(), 1u);
  EXPECT_EQ(std::get<1>(arm.removals[0]), b.front().lo);  // b went first
}

// Readers (probes, Route's ranking over a probe, counting matches, pins) run beside a writer
// that inserts into a pool too small for everything, so inserts evict all the time.
TEST(CacheIndexConcurrencyTest, ReadersRunBesideInsertsAndEvictions) {
  CacheIndexOptions options;
  options.hash_secret = HashKey{11, 22};
  options.policy = "cost";
  CacheIndex index(options);
  ASSERT_TRUE(index.RegisterModel(kNs, Mla()).ok());
  const PoolKey pools[] = {{"gpu-0", Tier::kGpu}, {"gpu-1", Tier::kGpu}};
  for (const PoolKey& pool : pools) {
    ASSERT_TRUE(index.SetPoolCapacity(pool, 30 * Mla().BytesPerPage()).ok());
  }
  std::vector<std::vector<PageHash>> prompts;
  for (uint32_t p = 0; p < 96; ++p) prompts.push_back(*index.HashTokens(kNs, PromptTokens(p)));
  const RouteCandidate candidates[] = {{.agent_id = "gpu-0", .link_gbps = 100},
                                       {.agent_id = "gpu-1", .link_gbps = 100}};
  const RouteCost cost{.bytes_per_page = Mla().BytesPerPage(),
                       .page_size_tokens = kPage,
                       .prefill_tokens_per_s = 10'000};

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> counting_matches{0};
  std::atomic<int> failures{0};
  auto check = [&](const absl::StatusOr<MatchResult>& m, size_t asked) {
    if (!m.ok() || m->matched_pages > asked) return ++failures, void();
    uint32_t pages = 0;
    for (const MatchedSegment& seg : m->segments) {
      if (seg.first_page != pages) ++failures;
      pages += seg.num_pages;
      if (seg.num_replicas == 0 || seg.first_replica + seg.num_replicas > m->replicas.size()) {
        ++failures;
        continue;
      }
      for (const MatchedReplica& r : m->Replicas(seg)) {
        if (r.pool == nullptr || r.first_block + seg.num_pages > m->block_ids.size()) ++failures;
      }
    }
    if (pages != m->matched_pages) ++failures;
  };
  auto reader = [&](uint32_t seed) {
    std::mt19937 rng(seed);
    while (!stop.load()) {
      const std::vector<PageHash>& pages = prompts[rng() % prompts.size()];
      switch (rng() % 4) {
        case 0:
          check(index.Match(kNs, pages, {.probe = true}), pages.size());
          break;
        case 1: {  // Route: rank over a probe, then count the match for the chosen agent
          absl::StatusOr<MatchResult> m = index.Match(kNs, pages, {.probe = true});
          check(m, pages.size());
          if (!m.ok()) break;
          std::vector<RouteEstimate> ranked =
              RankAgents(RoutePolicy::kPrefillSaved, *m, candidates, cost, 0, &pages[0]);
          const std::string& chosen = candidates[ranked.front().candidate].agent_id;
          check(index.Match(kNs, pages, {.requester_agent_id = chosen}), pages.size());
          ++counting_matches;
          break;
        }
        case 2:
          check(index.Match(kNs, pages, {}), pages.size());
          ++counting_matches;
          break;
        case 3: {  // a pin keeps its pages through the writer's evictions
          absl::StatusOr<MatchResult> m = index.Match(kNs, pages, {.pin = true});
          check(m, pages.size());
          ++counting_matches;
          if (!m.ok() || m->pin_id == 0) break;
          std::this_thread::yield();
          absl::StatusOr<MatchResult> again = index.Match(kNs, pages, {.probe = true});
          if (!again.ok() || again->matched_pages < m->matched_pages) ++failures;
          if (!index.Release(kNs, m->pin_id).ok()) ++failures;
          break;
        }
      }
    }
  };
  std::vector<std::thread> readers;
  for (uint32_t i = 0; i < 3; ++i) readers.emplace_back(reader, i + 1);
  std::mt19937 rng(99);
  uint32_t block = 0;
  uint64_t evicted = 0;
  for (int i = 0; i < 4'000; ++i) {
    const std::vector<PageHash>& pages = prompts[rng() % prompts.size()];
    absl::StatusOr<InsertResult> r =
        index.Insert(kNs, pages, pools[rng() % 2], Blocks(block, pages.size()));
    block += pages.size();
    // Pins may hold too much of the pool for a moment.
    if (!r.ok() && r.status().code() != absl::StatusCode::kResourceExhausted) ++failures;
    if (r.ok()) evicted += r->evicted_bytes;
  }
  stop = true;
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(evicted, 0u);
  const IndexStats stats = index.Stats();
  EXPECT_EQ(stats.counters.match_requests, counting_matches.load());
  EXPECT_EQ(stats.active_pins, 0u);
  EXPECT_TRUE(index.CheckTenantAccounting().ok());
  index.ExpireLeases();  // applies what is still pending
  EXPECT_TRUE(index.CheckTenantAccounting().ok());
}

}  // namespace
}  // namespace kvcm
