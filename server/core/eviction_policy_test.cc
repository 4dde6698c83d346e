#include "server/core/eviction_policy.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/cache_index.h"
#include "server/core/policies/registry.h"

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

// Every row of the table makes the policy it names; the clairvoyant rows need an oracle;
// a bad parameter is refused by its own row, at CacheIndexOptions::Validate too.
TEST(EvictionPolicyTest, EveryRowOfTheTableMakesItsPolicy) {
  for (const PolicyEntry& row : PolicyTable()) {
    absl::StatusOr<std::unique_ptr<EvictionPolicy>> p = MakeEvictionPolicy(row.name);
    if (row.clairvoyant) {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << row.name;
      EXPECT_THAT(p.status().message(), ::testing::HasSubstr("clairvoyant")) << row.name;
      EXPECT_THAT(PolicyHelp(), ::testing::Not(::testing::HasSubstr(std::string(row.name) + " (")));
    } else {
      ASSERT_TRUE(p.ok()) << row.name << ": " << p.status();
      EXPECT_EQ((*p)->name(), row.name);
      EXPECT_THAT(PolicyHelp(), ::testing::HasSubstr(absl::StrCat(row.name, " (", row.help)));
    }
    EXPECT_EQ(FindPolicy(row.name), &row);
    EXPECT_THAT(PolicyNames(true), ::testing::HasSubstr(row.name));
  }
  CacheIndexOptions bad_shift;
  bad_shift.policy = "conversation";
  bad_shift.conversation.shift = -1;
  EXPECT_EQ(bad_shift.Validate().code(), absl::StatusCode::kInvalidArgument)
      << "the conversation policy's own parameters are validated (they once were not)";
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
  p.OnGhostHit(*Leaf(next_id_++, 2, 20),
               {.hits = 1, .last_access_s = 0, .evicted_s = 10, .pages = 1}, 20);
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
    p.OnGhostHit(*Leaf(next_id_++, 2, 20),
                 {.hits = 1, .last_access_s = 0, .evicted_s = 10, .pages = 1}, 20);
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

// The density policy on leaves of one DeepSeek-V3-priced tree. Candidates live in pool 0;
// the lives it learns from are leaves of pool 1, so they never compete with them.
class DensityPolicyTest : public ::testing::Test {
 protected:
  static constexpr PoolId kPool = 0, kTeachPool = 1;

  DensityPolicyTest() : tree_(nullptr) { tree_.set_page_cost(70272 * 16, 16); }

  RadixNode* Leaf(PoolId pool, double last_access_s) {
    const uint64_t id = next_id_++;
    RadixNode* n = tree_.AddChild(tree_.root(), std::vector<PageHash>{{id, id}});
    n->replicas.push_back(Replica{.pool = pool, .evictable = true});
    n->hits = 1;
    n->last_access_s = last_access_s;
    return n;
  }

  // A candidate of kPool last used at `at_s`.
  RadixNode* Candidate(EvictionPolicy& p, double at_s) {
    RadixNode* n = Leaf(kPool, at_s);
    p.Touch(n, stamp_++, at_s, Access::kInsert);
    return n;
  }

  // `lives` leaves, each used once and reused `reuse_age_s` later, ending at `until_s`:
  // a workload whose runs come back after a steady interval (a conversation's next turn).
  void TeachSteadyReuse(EvictionPolicy& p, int lives, double reuse_age_s, double until_s) {
    for (int i = 0; i < lives; ++i) {
      const double at = until_s - reuse_age_s - (lives - i) * 1e-3;
      p.Touch(Leaf(kTeachPool, at), stamp_++, at + reuse_age_s, Access::kMatch);
    }
  }

  RadixTree tree_;
  uint64_t next_id_ = 1;
  uint64_t stamp_ = 1;
};

TEST_F(DensityPolicyTest, WithNothingLearntEvictsLeastRecentlyUsedFirst) {
  for (bool guard : {false, true}) {
    std::unique_ptr<EvictionPolicy> p = MakeHitDensityPolicy({.lru_guard = guard});
    RadixNode* old = Candidate(*p, 10);
    RadixNode* young = Candidate(*p, 20);
    EXPECT_EQ(p->Victim(kPool)->node, old);
    p->Remove(old, kPool);
    EXPECT_EQ(p->Victim(kPool)->node, young);
    EXPECT_FALSE(p->Victim(kTeachPool).has_value());
  }
}

TEST_F(DensityPolicyTest, KeepsWhatIsAboutToBeReusedOverWhatWasJustUsed) {
  // Runs come back 100 s after their last use. At 1,000 s a candidate last used 90 s ago
  // is due in 10 s; one used 5 s ago is due in 95 s: Belady evicts the young one, LRU the
  // old one.
  std::unique_ptr<EvictionPolicy> p = MakeHitDensityPolicy({.lru_guard = false});
  TeachSteadyReuse(*p, 1024, 100, 1000);
  RadixNode* due = Candidate(*p, 910);
  RadixNode* fresh = Candidate(*p, 995);
  p->Touch(Leaf(kTeachPool, 1000), stamp_++, 1000, Access::kInsert);  // the clock reads 1,000
  EXPECT_EQ(p->Victim(kPool)->node, fresh);
  // A candidate older than any reuse seen outlived them all: it goes before both.
  RadixNode* stale = Candidate(*p, 700);
  EXPECT_EQ(p->Victim(kPool)->node, stale);
  (void)due;
}

TEST_F(DensityPolicyTest, LruGuardDecidesWhileDensitysVictimsComeBackMoreOften) {
  std::unique_ptr<EvictionPolicy> p = MakeHitDensityPolicy({.lru_guard = true});
  TeachSteadyReuse(*p, 1024, 100, 1000);
  RadixNode* due = Candidate(*p, 910);
  RadixNode* fresh = Candidate(*p, 995);
  p->Touch(Leaf(kTeachPool, 1000), stamp_++, 1000, Access::kInsert);
  // No victim of either expert has come back yet: density decides.
  EXPECT_EQ(p->Victim(kPool)->node, fresh);

  // Density's victim comes back: the eviction it decided is asked for again.
  const uint8_t tag = p->OnGhostAdded(*fresh, 1000);
  EXPECT_NE(tag, 0);
  p->OnGhostHit(*fresh,
                {.hits = 1, .last_access_s = 995, .evicted_s = 1000, .pages = 1, .tag = tag}, 1001);
  // LRU's victims have not come back (it has decided none): it decides now.
  EXPECT_EQ(p->Victim(kPool)->node, due);
  // Where the experts agree, the victim is the same either way.
  p->Remove(fresh, kPool);
  EXPECT_EQ(p->Victim(kPool)->node, due);
}

TEST_F(DensityPolicyTest, TwoPoliciesFedTheSameEventsChooseTheSameVictims) {
  // Each policy gets its own nodes (scores live in the nodes), made the same way.
  std::vector<uint64_t> order[2];  // victims, by their creation order in their run
  for (int k = 0; k < 2; ++k) {
    std::unique_ptr<EvictionPolicy> p = MakeHitDensityPolicy({});
    const uint64_t first_id = next_id_;
    stamp_ = 1;
    TeachSteadyReuse(*p, 700, 30, 500);
    for (int i = 0; i < 20; ++i) Candidate(*p, 400 + 5 * i);
    while (std::optional<EvictionCandidate> v = p->Victim(kPool)) {
      order[k].push_back(v->node->pages[0].hi - first_id);
      p->Remove(v->node, kPool);
    }
  }
  EXPECT_EQ(order[0].size(), 20u);
  EXPECT_EQ(order[0], order[1]);
}

TEST(EvictionPolicyTest, FactoryMakesDensityAndChecksItsParameters) {
  EXPECT_EQ((*MakeEvictionPolicy("density"))->name(), "density");
  for (uint32_t classes : {1u, 2u, 4u}) {
    PolicyContext ok;
    ok.density.reuse_classes = classes;
    EXPECT_TRUE(MakeEvictionPolicy("density", ok).ok());
  }
  PolicyContext bad;
  bad.density.reuse_classes = 3;
  absl::StatusOr<std::unique_ptr<EvictionPolicy>> p = MakeEvictionPolicy("density", bad);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), ::testing::HasSubstr("reuse_classes"));
}

// Conversations in a DeepSeek-V3-priced tree for the conversation policy. Pool 0 holds the
// candidates a test ranks; the teaching leaves live in pool 1.
class ConversationPolicyTest : public ::testing::Test {
 protected:
  static constexpr PoolId kPool = 0;
  static constexpr PoolId kTeachPool = 1;

  ConversationPolicyTest() : tree_(nullptr) { tree_.set_page_cost(70272 * 16, 16); }

  // A leaf of `pages` pages added below `parent` at `at_s` and inserted, as CacheIndex does:
  // OnLeafAdded, then the touch of the insert.
  RadixNode* Add(EvictionPolicy& p, RadixNode* parent, uint32_t pages, double at_s,
                 PoolId pool = kTeachPool) {
    std::vector<PageHash> run;
    for (uint32_t i = 0; i < pages; ++i) run.push_back({next_id_, next_id_++});
    RadixNode* n = tree_.AddChild(parent, run);
    p.OnLeafAdded(*n, nullptr, at_s);
    n->replicas.push_back(Replica{.pool = pool, .evictable = true});
    p.Touch(n, stamp_++, at_s, Access::kInsert);
    p.Add(n, pool);
    return n;
  }

  // `n` one-page prompts that are never continued and `n` eight-page prompts whose next
  // turn comes `gap_s` later, ending by `until_s`.
  void Teach(EvictionPolicy& p, int n, double gap_s, double until_s) {
    for (int i = 0; i < n; ++i) {
      const double at = until_s - gap_s - (n - i) * 1e-3;
      Add(p, tree_.root(), 1, at);
      RadixNode* first = Add(p, tree_.root(), 8, at);
      p.Touch(first, stamp_++, at + gap_s, Access::kMatch);  // the next turn's match
      Add(p, first, 4, at + gap_s);
    }
  }

  RadixTree tree_;
  uint64_t next_id_ = 1;
  uint64_t stamp_ = 1;
};

TEST_F(ConversationPolicyTest, WithNothingLearntEvictsLeastRecentlyUsedFirst) {
  std::unique_ptr<EvictionPolicy> p = MakeConversationPolicy({});
  RadixNode* old = Add(*p, tree_.root(), 8, 10, kPool);
  RadixNode* young = Add(*p, tree_.root(), 1, 20, kPool);
  EXPECT_EQ(p->Victim(kPool)->node, old);
  p->Remove(old, kPool);
  EXPECT_EQ(p->Victim(kPool)->node, young);
}

TEST_F(ConversationPolicyTest, KeepsTheContextLikelierToBeContinuedOverAFresherOne) {
  std::unique_ptr<EvictionPolicy> p = MakeConversationPolicy({.shift = 1});
  Teach(*p, 512, 100, 1000);
  // At 1,000 s: a first turn of eight pages from 30 s ago (its class is continued) and a
  // one-page prompt from 5 s ago (its class never is). LRU would evict the older one.
  RadixNode* likely = Add(*p, tree_.root(), 8, 970, kPool);
  RadixNode* unlikely = Add(*p, tree_.root(), 1, 995, kPool);
  EXPECT_EQ(p->Victim(kPool)->node, unlikely);
  EXPECT_LT(p->Priority(unlikely, kPool), p->Priority(likely, kPool));

  // shift 0 is least-recently-used, whatever it learnt.
  std::unique_ptr<EvictionPolicy> lru_like = MakeConversationPolicy({.shift = 0});
  Teach(*lru_like, 512, 100, 1000);
  RadixNode* older = Add(*lru_like, tree_.root(), 8, 970, kPool);
  Add(*lru_like, tree_.root(), 1, 995, kPool);
  EXPECT_EQ(lru_like->Victim(kPool)->node, older);
}

TEST_F(ConversationPolicyTest, APromptExtendingAWholeLeafIsItsNextTurn) {
  std::unique_ptr<EvictionPolicy> p = MakeConversationPolicy({});
  RadixNode* first = Add(*p, tree_.root(), 4, 1);
  EXPECT_EQ(first->turn, 0);
  RadixNode* second = Add(*p, first, 4, 2);
  EXPECT_EQ(second->turn, 1);
  RadixNode* third = Add(*p, second, 4, 3);
  EXPECT_EQ(third->turn, 2);
  // A second branch below a node that already has a child shares a prefix: a new
  // conversation, not a next turn.
  EXPECT_EQ(Add(*p, second, 4, 4)->turn, 0);
  // An evicted turn-2 leaf asked for again with more pages: the next turn after it.
  RadixNode* back = tree_.AddChild(tree_.root(), std::vector<PageHash>{{900, 900}, {901, 901}});
  const uint8_t tag = p->OnGhostAdded(*third, 5);
  const EvictionPolicy::GhostHit ghost{
      .hits = 1, .last_access_s = 3, .evicted_s = 5, .pages = 1, .tag = tag};
  p->OnLeafAdded(*back, &ghost, 6);
  EXPECT_EQ(back->turn, 3);
}

TEST_F(ConversationPolicyTest, TwoPoliciesFedTheSameEventsRankAlike) {
  std::unique_ptr<EvictionPolicy> a = MakeConversationPolicy({});
  std::unique_ptr<EvictionPolicy> b = MakeConversationPolicy({});
  Teach(*a, 64, 50, 500);
  Teach(*b, 64, 50, 500);
  RadixNode* x = Add(*a, tree_.root(), 8, 480, kPool);
  RadixNode* y = Add(*b, tree_.root(), 8, 480, kPool);
  EXPECT_DOUBLE_EQ(a->Priority(x, kPool), b->Priority(y, kPool));
}

TEST(EvictionPolicyTest, FactoryMakesConversationAndChecksItsShift) {
  EXPECT_EQ((*MakeEvictionPolicy("conversation"))->name(), "conversation");
  for (double bad :
       {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    PolicyContext context;
    context.conversation.shift = bad;
    absl::StatusOr<std::unique_ptr<EvictionPolicy>> p = MakeEvictionPolicy("conversation", context);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(p.status().message(), ::testing::HasSubstr("shift"));
  }
}

TEST(EvictionPolicyTest, OptWhetherNeedsTheOracle) {
  absl::StatusOr<std::unique_ptr<EvictionPolicy>> p = MakeEvictionPolicy("opt-whether");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), ::testing::HasSubstr("oracle"));
}

}  // namespace
}  // namespace kvcm
