// "select" (select.h): it evicts exactly as its choice does, moves to a candidate whose
// miniature caches hit more (exactly simulated and sampled), keeps its choice within the
// margin, and stays sound when prompts arrive on several threads.
#include "server/core/policies/select.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/cache_index.h"
#include "server/core/clock.h"
#include "server/core/policies/registry.h"

namespace kvcm {
namespace {

constexpr uint32_t kPage = 4;  // tokens per page
const NamespaceId kNs{"acme", "deepseek-v3"};

// DeepSeek-V3 from the catalogue, with small pages.
ModelSpec Mla() {
  ModelSpec spec = *FindModel("deepseek-v3");
  spec.page_size_tokens = kPage;
  return spec;
}

// A prompt of `pages` pages whose token ids start at `first_id`: prompts with different
// first ids share no page.
std::vector<int32_t> Prompt(int32_t first_id, uint32_t pages) {
  std::vector<int32_t> tokens;
  for (uint32_t p = 0; p < pages; ++p) tokens.insert(tokens.end(), kPage, first_id + int32_t(p));
  return tokens;
}

// One CacheIndex with one GPU pool of `capacity_pages` pages, served as a worker would:
// Match by the pool's agent, then Insert of the whole prompt.
struct Arm {
  Arm(const std::string& policy, uint64_t capacity_pages, SelectParams select = {},
      uint64_t tenant_max_pages = 0) {
    select.sample_key = 12345;  // reproducible
    CacheIndexOptions options;
    options.policy = policy;
    options.clock = &clock;
    options.hash_secret = HashKey{11, 22};
    options.select = select;
    options.tenant_max_bytes = tenant_max_pages * Mla().BytesPerPage();
    index = std::make_unique<CacheIndex>(options);
    EXPECT_TRUE(index->RegisterModel(kNs, Mla()).ok());
    EXPECT_TRUE(index->SetPoolCapacity(gpu, capacity_pages * Mla().BytesPerPage()).ok());
  }

  // Hit pages of the request.
  uint32_t Serve(const std::vector<int32_t>& tokens, bool with_requester = true) {
    const std::vector<PageHash> pages = *index->HashTokens(kNs, tokens);
    MatchOptions match;
    if (with_requester) match.requester_agent_id = gpu.agent_id;
    absl::StatusOr<MatchResult> m = index->Match(kNs, pages, match);
    EXPECT_TRUE(m.ok()) << m.status();
    std::vector<BlockId> blocks(pages.size());
    for (BlockId& b : blocks) b = next_block++;
    absl::StatusOr<InsertResult> inserted = index->Insert(kNs, pages, gpu, blocks);
    EXPECT_TRUE(inserted.ok()) << inserted.status();
    clock.Advance(absl::Milliseconds(100));
    return m.ok() ? m->local_pages : 0;
  }

  FakeClock clock;
  PoolKey gpu{"gpu-0", Tier::kGpu};
  std::unique_ptr<CacheIndex> index;
  BlockId next_block = 0;
};

// A hot set of prompts reused every round, then a scan of one-time prompts larger than the
// pool: least-recently-used loses the hot set to every scan; a policy that credits reuse
// keeps it. Returns the hit pages and the prompt pages of rounds [from_round, rounds).
struct Rounds {
  uint64_t hits = 0, pages = 0;
  double rate() const { return pages == 0 ? 0 : double(hits) / pages; }
};
Rounds ScanRounds(Arm& arm, uint32_t scale, int rounds, int from_round) {
  Rounds out;
  int32_t scan_id = 1'000'000;
  for (int r = 0; r < rounds; ++r) {
    for (int32_t h = 0; h < 8; ++h) {
      const uint32_t hit = arm.Serve(Prompt(h * 1000, 4 * scale));
      if (r >= from_round) out.hits += hit, out.pages += 4 * scale;
    }
    for (int s = 0; s < 3; ++s) {
      arm.Serve(Prompt(scan_id, 16 * scale));
      scan_id += 100'000;
      if (r >= from_round) out.pages += 16 * scale;
    }
  }
  return out;
}

TEST(SelectTest, RefusesBadParametersNamingThem) {
  for (auto [field, params] : std::vector<std::pair<std::string, SelectParams>>{
           {"shadow_pages", {.shadow_pages = 10}},
           {"margin_points", {.margin_points = -1}},
           {"window_capacities", {.window_capacities = 0}},
           {"dwell_capacities", {.dwell_capacities = -1}},
           {"initial", {.initial = "opt"}}}) {
    CacheIndexOptions options;
    options.policy = "select";
    options.select = params;
    const absl::Status s = options.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(s.message(), ::testing::HasSubstr(field));
  }
}

TEST(SelectTest, TakesItsCandidatesFromTheTable) {
  absl::StatusOr<std::unique_ptr<SelectingPolicy>> p = SelectingPolicy::Create({});
  ASSERT_TRUE(p.ok()) << p.status();
  const SelectionStats stats = *(*p)->selection();
  std::vector<std::string> names;
  for (const SelectionStats::Candidate& c : stats.candidates) names.push_back(c.name);
  EXPECT_THAT(names, ::testing::ElementsAre("lru", "cost", "adaptive", "density", "conversation"));
  EXPECT_EQ((*p)->selection()->active, SelectParams{}.initial);
  for (const std::string& name : names) {
    absl::StatusOr<std::unique_ptr<SelectingPolicy>> from =
        SelectingPolicy::Create({.select = {.initial = name}});
    ASSERT_TRUE(from.ok()) << from.status();
    EXPECT_EQ((*from)->selection()->active, name);
  }
}

// Held to a margin no candidate can pass, select never moves, and evicts exactly as lru:
// every request hits the same pages in both.
TEST(SelectTest, WithoutAMoveItEvictsExactlyAsLru) {
  Arm select("select", 64, {.margin_points = 100, .initial = "lru"}), lru("lru", 64);
  int32_t scan_id = 1'000'000;
  for (int r = 0; r < 30; ++r) {
    for (int32_t h = 0; h < 8; ++h) {
      ASSERT_EQ(select.Serve(Prompt(h * 1000, 4)), lru.Serve(Prompt(h * 1000, 4))) << r;
    }
    ASSERT_EQ(select.Serve(Prompt(scan_id, 16)), lru.Serve(Prompt(scan_id, 16)));
    scan_id += 100'000;
  }
  const SelectionStats stats = *select.index->Stats().selection;
  EXPECT_EQ(stats.active, "lru");
  EXPECT_EQ(stats.switches, 0u);
  EXPECT_GT(stats.sampled_lookup_pages, 0u);
  EXPECT_EQ(stats.min_sample_rate, 1.0) << "a 64-page pool is simulated whole";
  EXPECT_EQ(select.index->Stats().counters.evicted_pages,
            lru.index->Stats().counters.evicted_pages);
}

// The scan workload, simulated exactly (a pool within shadow_pages) and sampled (a pool 16x
// larger than shadow_pages): select moves off lru and, once moved, hits within a few points
// of the best candidate run alone, far above lru.
void ExpectItMovesToTheBetterCandidate(uint32_t scale, uint32_t shadow_pages) {
  const uint64_t capacity = 64 * scale;
  Arm select("select", capacity, {.shadow_pages = shadow_pages, .initial = "lru"},
             /*tenant_max_pages=*/capacity);
  const Rounds chosen = ScanRounds(select, scale, 60, 30);
  double best = 0, lru = 0;
  std::string best_name;
  for (const PolicyEntry& row : PolicyTable()) {
    if (!row.candidate) continue;
    Arm alone(std::string(row.name), capacity);
    const double rate = ScanRounds(alone, scale, 60, 30).rate();
    if (row.name == "lru") lru = rate;
    if (rate > best) best = rate, best_name = std::string(row.name);
  }
  const SelectionStats stats = *select.index->Stats().selection;
  EXPECT_NE(stats.active, "lru");
  EXPECT_GE(stats.switches, 1u);
  EXPECT_GT(best, lru + 0.2) << "the workload must separate lru from the best (" << best_name
                             << ")";
  EXPECT_GE(chosen.rate(), best - 0.03) << "chose " << stats.active << ", best " << best_name;
  EXPECT_TRUE(select.index->CheckTenantAccounting().ok());
  const IndexStats index = select.index->Stats();
  EXPECT_LE(index.pools[0].used_bytes, index.pools[0].capacity_bytes);
}

TEST(SelectTest, MovesToTheBetterCandidateSimulatedExactly) {
  ExpectItMovesToTheBetterCandidate(/*scale=*/1, /*shadow_pages=*/4096);
}

TEST(SelectTest, MovesToTheBetterCandidateFromASample) {
  // 1,024 pages against 64: a sample rate of 1/16.
  ExpectItMovesToTheBetterCandidate(/*scale=*/16, /*shadow_pages=*/64);
}

// A dropped pool (its agent's epoch ended) takes its miniature pools with it: agents that
// come and go cannot grow the miniature indexes.
TEST(SelectTest, ADroppedPoolLeavesTheMiniatureCaches) {
  Arm select("select", 64);
  ScanRounds(select, 1, 3, 0);
  const SelectionStats before = *select.index->Stats().selection;
  EXPECT_EQ(before.pools, 1u);
  EXPECT_GT(before.shadow_pages, 0u);
  ASSERT_TRUE(select.index->DropPool(select.gpu).ok());
  const SelectionStats after = *select.index->Stats().selection;
  EXPECT_EQ(after.pools, 0u);
  EXPECT_EQ(after.shadow_pages, 0u);
  // The pool's next incarnation is shadowed afresh.
  ScanRounds(select, 1, 1, 0);
  EXPECT_EQ(select.index->Stats().selection->pools, 1u);
}

// Matches that name no agent are not lookups of any pool: the sample sees none of them,
// and the choice stays where it is.
TEST(SelectTest, LookupsWithoutARequesterAreNotSampled) {
  Arm select("select", 64, {.initial = "lru"});
  int32_t scan_id = 1'000'000;
  for (int r = 0; r < 20; ++r) {
    for (int32_t h = 0; h < 8; ++h) select.Serve(Prompt(h * 1000, 4), /*with_requester=*/false);
    select.Serve(Prompt(scan_id += 100'000, 48), /*with_requester=*/false);
  }
  const SelectionStats stats = *select.index->Stats().selection;
  EXPECT_EQ(stats.sampled_lookup_pages, 0u);
  EXPECT_GT(stats.sampled_store_pages, 0u);
  EXPECT_EQ(stats.active, "lru");
}

// Counting matches share the index's lock, so prompts reach the policy from several threads
// at once while a writer inserts and moves the choice.
TEST(SelectTest, PromptsFromSeveralThreadsAtOnce) {
  Arm select("select", 64, {.window_capacities = 0.5});
  std::atomic<bool> done = false;
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&, t] {
      const std::vector<PageHash> pages = *select.index->HashTokens(kNs, Prompt(t * 1000, 4));
      while (!done.load()) {
        ASSERT_TRUE(select.index->Match(kNs, pages, {.requester_agent_id = "gpu-0"}).ok());
      }
    });
  }
  ScanRounds(select, 1, 40, 0);
  done = true;
  for (std::thread& t : readers) t.join();
  EXPECT_TRUE(select.index->CheckTenantAccounting().ok());
  EXPECT_GT(select.index->Stats().selection->sampled_lookup_pages, 0u);
}

}  // namespace
}  // namespace kvcm
