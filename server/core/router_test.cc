#include "server/core/router.h"

#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/clock.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;

constexpr uint32_t kPage = 4;

ModelSpec Mla() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = kPage};
}

class RouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = std::make_unique<CacheIndex>(
        CacheIndexOptions{.hash_secret = HashKey{1, 2}, .clock = &clock_});
    ASSERT_TRUE(index_->RegisterModel(ns_, Mla()).ok());
    cost_ = RouteCost{.bytes_per_page = Mla().BytesPerPage(),
                      .page_size_tokens = kPage,
                      .prefill_tokens_per_s = 10'000};
  }

  std::vector<PageHash> Prompt(int pages, int32_t salt = 0) {
    std::vector<int32_t> tokens(pages * kPage);
    std::iota(tokens.begin(), tokens.end(), salt * 100'000);
    return *index_->HashTokens(ns_, tokens);
  }

  void Put(std::span<const PageHash> pages, const std::string& agent, Tier tier = Tier::kGpu) {
    std::vector<BlockId> blocks(pages.size());
    std::iota(blocks.begin(), blocks.end(), next_block_);
    next_block_ += pages.size();
    ASSERT_TRUE(index_->Insert(ns_, pages, PoolKey{agent, tier}, blocks).ok());
  }

  MatchResult Probe(std::span<const PageHash> pages, const std::string& requester = "") {
    absl::StatusOr<MatchResult> m =
        index_->Match(ns_, pages, {.requester_agent_id = requester, .probe = true});
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *m : MatchResult{};
  }

  static std::vector<std::string> Ids(const std::vector<RouteEstimate>& ranked,
                                      std::span<const RouteCandidate> candidates) {
    std::vector<std::string> ids;
    for (const RouteEstimate& e : ranked) ids.push_back(candidates[e.candidate].agent_id);
    return ids;
  }

  FakeClock clock_;
  std::unique_ptr<CacheIndex> index_;
  const NamespaceId ns_{"t", "m"};
  RouteCost cost_;
  BlockId next_block_ = 0;
};

TEST_F(RouterTest, CountsCachedPagesPerAgentFromOneMatch) {
  std::vector<PageHash> p = Prompt(8);
  Put(std::span(p).first(6), "a");
  Put(std::span(p).first(2), "b");
  Put(std::span(p).first(3), "b", Tier::kHost);  // an agent's HOST pool counts as its own
  const MatchResult m = Probe(p);
  const RouteCandidate a{"a", 0, 400}, b{"b", 0, 400}, c{"c", 0, 400};
  EXPECT_EQ(EstimateFor(m, 0, a, cost_).cached_pages, 6u);
  EXPECT_EQ(EstimateFor(m, 1, b, cost_).cached_pages, 3u);
  EXPECT_EQ(EstimateFor(m, 2, c, cost_).cached_pages, 0u);
  // The same numbers whoever the match was taken for, and the index's own local_pages.
  for (const RouteCandidate& cand : {a, b, c}) {
    const MatchResult own = Probe(p, cand.agent_id);
    EXPECT_EQ(EstimateFor(own, 0, cand, cost_).cached_pages, own.local_pages) << cand.agent_id;
  }
}

TEST_F(RouterTest, FetchesWhenMovingBeatsRecomputing) {
  std::vector<PageHash> p = Prompt(8);
  Put(std::span(p).first(6), "a");
  const MatchResult m = Probe(p);
  // A DeepSeek-V3 page of 4 tokens is 281 KB: 5.6 us at 400 Gbit/s, 400 us to recompute.
  const RouteEstimate fast = EstimateFor(m, 0, {"b", 0, 400}, cost_);
  EXPECT_EQ(fast.cached_pages, 0u);
  EXPECT_EQ(fast.fetch_pages, 6u);
  EXPECT_EQ(fast.recompute_pages, 2u);
  const double transfer_ms = 1e3 * 6 * cost_.bytes_per_page * 8 / 400e9;
  EXPECT_DOUBLE_EQ(fast.transfer_ms, transfer_ms);
  EXPECT_DOUBLE_EQ(fast.saved_prefill_ms, 6 * 1e3 * kPage / 10'000.0 - transfer_ms);
  // Over a link so slow that moving costs more than recomputing, nothing is fetched.
  const RouteEstimate slow = EstimateFor(m, 0, {"b", 0, 0.001}, cost_);
  EXPECT_EQ(slow.fetch_pages, 0u);
  EXPECT_EQ(slow.recompute_pages, 8u);
  EXPECT_EQ(slow.transfer_ms, 0);
  EXPECT_EQ(slow.saved_prefill_ms, 0);
  // The holder itself saves the most: no transfer.
  const RouteEstimate own = EstimateFor(m, 0, {"a", 0, 400}, cost_);
  EXPECT_EQ(own.cached_pages, 6u);
  EXPECT_EQ(own.fetch_pages, 0u);
  EXPECT_GT(own.saved_prefill_ms, fast.saved_prefill_ms);
}

TEST_F(RouterTest, PrefillSavedPrefersTheHolderThenLoad) {
  std::vector<PageHash> p = Prompt(8);
  Put(std::span(p).first(2), "a");
  Put(std::span(p).first(5), "c");
  const MatchResult m = Probe(p);
  const std::vector<RouteCandidate> cands = {
      {"a", 0, 400}, {"b", 3, 400}, {"c", 9, 400}, {"d", 1, 400}};
  const std::vector<RouteEstimate> ranked =
      RankAgents(RoutePolicy::kPrefillSaved, m, cands, cost_, 0, &p[0]);
  // c holds 5 pages; a holds 2 and fetches 3; b and d fetch 5 (d has the lower load).
  EXPECT_THAT(Ids(ranked, cands), ElementsAre("c", "a", "d", "b"));
  EXPECT_EQ(ranked[0].cached_pages, 5u);
  EXPECT_EQ(ranked[1].cached_pages, 2u);
  EXPECT_EQ(ranked[1].fetch_pages, 3u);
}

TEST_F(RouterTest, PrefillSavedChargesTheQueueAgainstTheSaving) {
  std::vector<PageHash> p = Prompt(8);
  Put(p, "a");
  const MatchResult m = Probe(p);
  // a holds all 8 pages (3.2 ms of prefill at 10k tokens/s) but has 100 ms of prefill
  // queued; b fetches them and has nothing queued.
  std::vector<RouteCandidate> cands = {
      {.agent_id = "a", .link_gbps = 400, .queued_prefill_tokens = 1000},
      {.agent_id = "b", .link_gbps = 400}};
  std::vector<RouteEstimate> ranked =
      RankAgents(RoutePolicy::kPrefillSaved, m, cands, cost_, 0, &p[0]);
  EXPECT_THAT(Ids(ranked, cands), ElementsAre("b", "a"));
  EXPECT_DOUBLE_EQ(ranked[1].queue_ms, 100);
  EXPECT_EQ(ranked[0].fetch_pages, 8u);
  // A queue shorter than the transfer it avoids keeps the holder first: 0.1 ms of queue
  // against 1.8 ms to move 2.2 MB over 10 Gbit/s.
  cands[0].queued_prefill_tokens = 1;
  cands[1].link_gbps = 10;
  ranked = RankAgents(RoutePolicy::kPrefillSaved, m, cands, cost_, 0, &p[0]);
  EXPECT_THAT(Ids(ranked, cands), ElementsAre("a", "b"));
}

TEST_F(RouterTest, CacheBlindPoliciesIgnoreTheCache) {
  std::vector<PageHash> p = Prompt(4);
  Put(p, "c");
  const MatchResult m = Probe(p);
  const std::vector<RouteCandidate> cands = {{"a", 5, 400}, {"b", 2, 400}, {"c", 7, 400}};
  EXPECT_THAT(Ids(RankAgents(RoutePolicy::kRoundRobin, m, cands, cost_, 4, &p[0]), cands),
              ElementsAre("b", "c", "a"));
  EXPECT_THAT(Ids(RankAgents(RoutePolicy::kLeastLoaded, m, cands, cost_, 0, &p[0]), cands),
              ElementsAre("b", "a", "c"));
  const size_t start = p[0].lo % 3;
  const std::vector<RouteEstimate> hashed =
      RankAgents(RoutePolicy::kFirstPageHash, m, cands, cost_, 0, &p[0]);
  EXPECT_EQ(hashed[0].candidate, start);
  EXPECT_EQ(RankAgents(RoutePolicy::kFirstPageHash, m, cands, cost_, 0, nullptr)[0].candidate, 0u);
  // Whatever the order, each estimate is the candidate's own.
  for (const RouteEstimate& e : hashed) {
    EXPECT_EQ(e.cached_pages, cands[e.candidate].agent_id == "c" ? 4u : 0u);
  }
}

TEST_F(RouterTest, NoCandidatesNoRanking) {
  std::vector<PageHash> p = Prompt(2);
  for (RoutePolicy policy : {RoutePolicy::kPrefillSaved, RoutePolicy::kRoundRobin,
                             RoutePolicy::kFirstPageHash, RoutePolicy::kLeastLoaded}) {
    EXPECT_TRUE(RankAgents(policy, Probe(p), {}, cost_, 3, &p[0]).empty());
  }
}

TEST_F(RouterTest, PolicyNamesRoundTrip) {
  for (RoutePolicy policy : {RoutePolicy::kPrefillSaved, RoutePolicy::kRoundRobin,
                             RoutePolicy::kFirstPageHash, RoutePolicy::kLeastLoaded}) {
    EXPECT_EQ(*ParseRoutePolicy(RoutePolicyName(policy)), policy);
  }
  EXPECT_EQ(ParseRoutePolicy("random").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterTest, CostValidationNamesTheField) {
  RouteCost bad = cost_;
  bad.prefill_tokens_per_s = std::nan("");
  EXPECT_THAT(bad.Validate().message(), ::testing::HasSubstr("prefill_tokens_per_s"));
  bad = cost_;
  bad.bytes_per_page = 0;
  EXPECT_THAT(bad.Validate().message(), ::testing::HasSubstr("bytes_per_page"));
  EXPECT_TRUE(cost_.Validate().ok());
}

}  // namespace
}  // namespace kvcm
