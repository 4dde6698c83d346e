#include "server/core/lease_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(LeaseTableTest, FindsLiveLeasesOfTheirTreeOnly) {
  RadixTree tree(nullptr), other(nullptr);
  LeaseTable table(absl::Minutes(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PinId id = table.Add(tree.root(), t0 + absl::Seconds(5));
  ASSERT_TRUE(table.Find(id, &tree).ok());
  EXPECT_EQ(table.Find(id, &other).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Find(id + 1, &tree).status().code(), absl::StatusCode::kNotFound);
}

TEST(LeaseTableTest, ExpiresInOrderAndRemembersExpiredIds) {
  RadixTree tree(nullptr);
  LeaseTable table(absl::Seconds(60));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PinId late = table.Add(tree.root(), t0 + absl::Seconds(10));
  PinId early = table.Add(tree.root(), t0 + absl::Seconds(5));
  std::vector<PinId> expired;
  auto collect = [&](const Lease& l) { expired.push_back(l.id); };

  table.Expire(t0 + absl::Seconds(4), collect);
  EXPECT_TRUE(expired.empty());
  table.Expire(t0 + absl::Seconds(10), collect);
  EXPECT_EQ(expired, (std::vector<PinId>{early, late}));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.Find(early, &tree).status().code(), absl::StatusCode::kAborted);

  // After the memory window an expired id is simply unknown.
  table.Expire(t0 + absl::Seconds(80), collect);
  EXPECT_EQ(table.Find(early, &tree).status().code(), absl::StatusCode::kNotFound);
}

TEST(LeaseTableTest, RenewMovesExpiry) {
  RadixTree tree(nullptr);
  LeaseTable table(absl::Seconds(60));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PinId id = table.Add(tree.root(), t0 + absl::Seconds(5));
  table.SetExpiry(*table.Find(id, &tree), t0 + absl::Seconds(50));
  int n = 0;
  table.Expire(t0 + absl::Seconds(30), [&](const Lease&) { ++n; });
  EXPECT_EQ(n, 0);
  table.Erase(id);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.Find(id, &tree).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcm
