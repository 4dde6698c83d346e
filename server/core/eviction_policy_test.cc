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

}  // namespace
}  // namespace kvcm
