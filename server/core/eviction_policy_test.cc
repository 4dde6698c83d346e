#include "server/core/eviction_policy.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(LruPolicyTest, EvictsLeastRecentlyStampedFirstPerPool) {
  RadixTree tree(nullptr);
  RadixNode* a = tree.AddChild(tree.root(), std::vector<PageHash>{{1, 1}});
  RadixNode* b = tree.AddChild(tree.root(), std::vector<PageHash>{{2, 2}});
  for (RadixNode* n : {a, b}) n->replicas.push_back(Replica{.pool = 0, .evictable = true});
  std::unique_ptr<EvictionPolicy> lru = MakeLruPolicy();
  lru->Touch(a, 1, 0.0, Access::kMatch);
  lru->Touch(b, 2, 0.0, Access::kMatch);
  lru->Add(a, 0);
  lru->Add(b, 0);
  EXPECT_EQ(lru->Victim(0)->node, a);
  EXPECT_FALSE(lru->Victim(1).has_value());

  lru->Touch(a, 3, 0.0, Access::kMatch);  // a is now the most recent
  EXPECT_EQ(lru->Victim(0)->node, b);
  EXPECT_LT(lru->Priority(b, 0), lru->Priority(a, 0));
  lru->Remove(b, 0);
  EXPECT_EQ(lru->Victim(0)->node, a);
  lru->Remove(a, 0);
  EXPECT_FALSE(lru->Victim(0).has_value());
}

TEST(EvictionPolicyTest, FactoryKnowsLruAndNamesTheKnownOnes) {
  EXPECT_EQ((*MakeEvictionPolicy("lru"))->name(), "lru");
  absl::StatusOr<std::unique_ptr<EvictionPolicy>> bad = MakeEvictionPolicy("fifo");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("lru"));
}

// Nodes of a DeepSeek-V3-priced tree for the adaptive policy, each an unpinned leaf of
// pool 0.
class AdaptivePolicyTest : public ::testing::Test {
 protected:
  AdaptivePolicyTest() : tree_(nullptr) { tree_.set_page_cost(70272 * 16, 16); }

  RadixNode* Leaf(uint64_t id, uint32_t hits, double last_access_s) {
    RadixNode* n = tree_.AddChild(tree_.root(), std::vector<PageHash>{{id, id}});
    n->replicas.push_back(Replica{.pool = 0, .evictable = true});
    n->hits = hits;
    n->last_access_s = last_access_s;
    return n;
  }

  // A run used once, last accessed at 0, evicted at `now_s`: sets the eviction age.
  void EvictOnce(AdaptivePolicy& p, double now_s) {
    p.OnGhostAdded(*Leaf(next_id_++, 1, 0), now_s);
  }

  RadixTree tree_;
  uint64_t next_id_ = 1000;
  uint64_t stamp_ = 1;
};

TEST_F(AdaptivePolicyTest, CreditKeptInVainAndRegrettedOnceRunsLowerIt) {
  AdaptivePolicy p({.initial_credit = 1, .min_credit = 0, .max_credit = 2, .step = 0.1});
  EvictOnce(p, 10);  // eviction age 10 s
  // A reused node evicted at 100 s without its credit buying a hit.
  p.OnGhostAdded(*Leaf(1, 3, 0), 100);
  EXPECT_DOUBLE_EQ(p.credit(), 0.9);
  // A run used once comes back: evicting it was a mistake, the credit crowded it out.
  p.OnGhostHit(1, 0, 20);
  EXPECT_DOUBLE_EQ(p.credit(), 0.8);
}

TEST_F(AdaptivePolicyTest, ReusedNodesHitPastTheEvictionAgeRaiseIt) {
  AdaptivePolicy p({.initial_credit = 1, .min_credit = 0, .max_credit = 2, .step = 0.1});
  EvictOnce(p, 10);
  RadixNode* kept = Leaf(1, 2, 0);
  // Hit at age 50 s, past the 10 s recency alone keeps a page: the credit paid off.
  p.Touch(kept, stamp_++, 50, Access::kMatch);
  EXPECT_DOUBLE_EQ(p.credit(), 1.1);
  // A hit within the eviction age says nothing about the credit.
  p.Touch(kept, stamp_++, 55, Access::kMatch);
  EXPECT_DOUBLE_EQ(p.credit(), 1.1);
  // Nor does an insert, or a node never reused before.
  p.Touch(kept, stamp_++, 500, Access::kInsert);
  p.Touch(Leaf(2, 1, 0), stamp_++, 500, Access::kMatch);
  EXPECT_DOUBLE_EQ(p.credit(), 1.1);
  EXPECT_GT(p.reuse_interval_s(), 0);
}

TEST_F(AdaptivePolicyTest, CreditStaysWithinItsBounds) {
  AdaptivePolicy p({.initial_credit = 1, .min_credit = 0.5, .max_credit = 1.5, .step = 0.1});
  EvictOnce(p, 10);
  for (int i = 0; i < 100; ++i) p.Touch(Leaf(10 + i, 2, 0), stamp_++, 1000 + i, Access::kMatch);
  EXPECT_DOUBLE_EQ(p.credit(), 1.5);
  for (int i = 0; i < 300; ++i) {
    p.OnGhostAdded(*Leaf(200 + i, 3, 0), 5000);
    p.OnGhostHit(1, 0, 20);
  }
  EXPECT_DOUBLE_EQ(p.credit(), 0.5);
  // The initial credit is clamped into the bounds too.
  EXPECT_DOUBLE_EQ(AdaptivePolicy({.initial_credit = 9, .max_credit = 2, .step = 0.1}).credit(), 2);
}

TEST_F(AdaptivePolicyTest, CreditKeepsReusedNodesLongerAndIsDeterministic) {
  // Two policies fed the same events order the same nodes the same way.
  auto run = [&](std::vector<RadixNode*> nodes) {
    AdaptivePolicy p({.initial_credit = 1, .max_credit = 2, .step = 0.1});
    EvictOnce(p, 10);
    p.Touch(nodes[0], stamp_++, 100, Access::kMatch);   // reused: interval 100 s, credit up
    p.Touch(nodes[1], stamp_++, 150, Access::kInsert);  // newer, never reused
    for (RadixNode* n : nodes) p.Add(n, 0);
    std::vector<RadixNode*> order;
    while (std::optional<EvictionCandidate> v = p.Victim(0)) {
      order.push_back(v->node);
      p.Remove(v->node, 0);
    }
    return std::make_pair(order, p.credit());
  };
  const auto a = run({Leaf(1, 1, 0), Leaf(2, 0, 0)});
  const auto b = run({Leaf(3, 1, 0), Leaf(4, 0, 0)});
  EXPECT_DOUBLE_EQ(a.second, b.second);
  ASSERT_EQ(a.first.size(), 2u);
  // The reused node, older by 50 s but credited ~100 s, outlives the unused newer one.
  EXPECT_EQ(a.first[0]->pages[0], (PageHash{2, 2}));
  EXPECT_EQ(b.first[0]->pages[0], (PageHash{4, 4}));
}

TEST(EvictionPolicyTest, FactoryMakesAdaptiveAndChecksItsParameters) {
  EXPECT_EQ((*MakeEvictionPolicy("adaptive"))->name(), "adaptive");
  PolicyContext bad;
  bad.adaptive.step = 0;
  EXPECT_EQ(MakeEvictionPolicy("adaptive", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad.adaptive = {.min_credit = 2, .max_credit = 1};
  EXPECT_EQ(MakeEvictionPolicy("adaptive", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm
